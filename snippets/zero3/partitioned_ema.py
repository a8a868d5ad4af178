"""An EMA of the weights under ZeRO-3 that keeps ZeRO-3's saving: each rank averages only its
own partition of the optimizer's fp32 weights (deepspeed.utils.safe_get_local_fp32_param), and
the full average is gathered only when it is needed. Checked against plain PyTorch.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/partitioned_ema.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

DIM, BATCH, STEPS, DECAY, SEED, LR = 4, 2, 4, 0.9, 0, 0.01


def build_model():
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))


def make_batch(step):
    """The same batch on every rank, so the gradient equals the one-process gradient."""
    generator = torch.Generator().manual_seed(SEED + step)
    return torch.randn(BATCH, DIM, generator=generator), torch.randn(BATCH, 1, generator=generator)


# --8<-- [start:ema]
def local_ema_start(engine):
    """This rank's part of every weight: no collective, 1/world of the model per rank."""
    return {name: deepspeed.utils.safe_get_local_fp32_param(p).clone()
            for name, p in engine.module.named_parameters()}


def local_ema_update(engine, ema):
    """After engine.step(): average this rank's partition only; no rank waits for another."""
    for name, p in engine.module.named_parameters():
        ema[name].mul_(DECAY).add_(deepspeed.utils.safe_get_local_fp32_param(p), alpha=1 - DECAY)


def full_ema(engine, ema, name):
    """The whole average of one weight, when you need it (to evaluate or save): a collective,
    every rank must call it. Each rank holds an equal, padded slice of the flat weight."""
    param = dict(engine.module.named_parameters())[name]
    parts = [torch.empty_like(ema[name]) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, ema[name])
    return torch.cat(parts)[:param.ds_numel].view(param.ds_shape)
# --8<-- [end:ema]


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
    # --8<-- [start:train]
    ema = local_ema_start(engine)
    for step in range(STEPS):
        inputs, targets = make_batch(step)
        loss = F.mse_loss(engine(inputs.to(engine.device)), targets.to(engine.device))
        engine.backward(loss)
        engine.step()
        local_ema_update(engine, ema)
    full = {name: full_ema(engine, ema, name) for name in ema}  # every rank
    # --8<-- [end:train]
    held = sum(t.numel() for t in ema.values())
    whole = sum(p.ds_numel for p in engine.module.parameters())
    if rank == 0:
        print(f"rank 0 keeps {held} of the {whole} EMA values; "
              f"full EMA of 0.weight, row 0: {[round(v, 4) for v in full['0.weight'][0].tolist()]}")
    torch.distributed.destroy_process_group()
    return {"local": ema, "full": full, "held": held, "whole": whole}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
