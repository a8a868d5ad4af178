"""Jobs on full weights during ZeRO-3 training: read a full gradient, log a full weight, keep an EMA
of the full weights, and change a weight mid-training (surgery). Checked against plain PyTorch.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/full_weights_in_training.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

DIM, BATCH, STEPS, SURGERY_STEP, DECAY, SEED, LR = 4, 2, 4, 2, 0.9, 0, 0.01


def build_model():
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))


def make_batch(step):
    """The same batch on every rank, so the gradient equals the one-process gradient."""
    generator = torch.Generator().manual_seed(SEED + step)
    return torch.randn(BATCH, DIM, generator=generator), torch.randn(BATCH, 1, generator=generator)


# --8<-- [start:surgery]
def set_full_weight(param, value):
    """Change a trained ZeRO-3 weight on every rank, in both copies DeepSpeed keeps."""
    with deepspeed.zero.GatheredParameters(param, modifier_rank=0):
        with torch.no_grad():
            param.copy_(value)  # the model's copy: the next forward computes with it
    # The optimizer's copy: engine.step() keeps it.
    deepspeed.utils.safe_set_full_fp32_param(param, value)
# --8<-- [end:surgery]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    first = engine.module[0].weight
    ema = {name: deepspeed.utils.safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}
    losses, grads, norms = [], [], []
    for step in range(STEPS):
        if step == SURGERY_STEP:
            # --8<-- [start:surgery_call]
            new = deepspeed.utils.safe_get_full_fp32_param(first).clone()
            new[0] = 0.0  # e.g. reset one unit of the first layer
            set_full_weight(first, new)
            # --8<-- [end:surgery_call]
        inputs, targets = make_batch(step)
        loss = F.mse_loss(engine(inputs.to(engine.device)), targets.to(engine.device))
        engine.backward(loss)
        # --8<-- [start:grad]
        # Between engine.backward and engine.step:
        grad = deepspeed.utils.safe_get_full_grad(first)
        # --8<-- [end:grad]
        grads.append(grad.clone())
        engine.step()
        # --8<-- [start:log]
        # Every rank must call it:
        norm = deepspeed.utils.safe_get_full_fp32_param(first).norm().item()
        # --8<-- [end:log]
        # --8<-- [start:ema]
        for name, param in engine.module.named_parameters():  # every rank runs the same loop
            full = deepspeed.utils.safe_get_full_fp32_param(param)
            ema[name].mul_(DECAY).add_(full, alpha=1 - DECAY)
        # --8<-- [end:ema]
        losses.append(loss.item())
        norms.append(norm)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}, full grad norm {grad.norm().item():.4f}, "
                  f"weight norm {norm:.4f}, EMA norm {ema['0.weight'].norm().item():.4f}")
    torch.distributed.destroy_process_group()
    return {"losses": losses, "grads": grads, "norms": norms, "ema": ema}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
