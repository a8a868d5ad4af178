"""DeepSpeed's pattern, `with deepspeed.zero.Init(): model = ...`, with a Hugging Face
Auto class whose model module is first imported inside the `with` block. On the versions
stamped on the page, building the model fails with a TypeError from torch (the page says
why). The fixes, import_first_zero_init.py and hf_config_zero_init.py, import what they
share from this file.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/import_inside_zero_init.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import transformers
from deepspeed.accelerator import get_accelerator

VOCAB, SEQ, BATCH, STEPS, SEED, LR = 37, 8, 8, 3, 0, 0.1


def tiny_gpt2_config():
    """A one-layer GPT-2 from a config (nothing is downloaded), without dropout."""
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )


def zero3_config(world_size):
    return {
        "train_micro_batch_size_per_gpu": BATCH // world_size,
        # Partition even these tiny weights, as large ones are.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # no clipping: the run must equal plain PyTorch
    }


def make_batch(step):
    """Random tokens, the same on every rank and every run (GPT-2 shifts the labels)."""
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def train(model, ds_config):
    """Train under ZeRO-3: the full initial weights, each step's loss and grads."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    weight = model.transformer.wte.weight
    if rank == 0:
        print("wte.weight:", tuple(weight.shape), "full:", tuple(weight.ds_shape))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=ds_config)
    losses, grads = [], []
    for step in range(STEPS):
        tokens = make_batch(step)[rank::world].to(engine.device)  # this rank's share
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        grads.append({name: deepspeed.utils.safe_get_full_grad(p).cpu()
                      for name, p in engine.module.named_parameters()})
        engine.step()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
    torch.distributed.destroy_process_group()  # leave cleanly before the process exits
    return {"shape": tuple(weight.shape), "initial": initial,
            "losses": losses, "grads": grads}


def main():
    backend = get_accelerator().communication_backend_name()  # gloo on CPU
    deepspeed.init_distributed(dist_backend=backend)
    ds_config = zero3_config(torch.distributed.get_world_size())
    torch.manual_seed(SEED)
    # --8<-- [start:fails]
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = transformers.AutoModelForCausalLM.from_config(tiny_gpt2_config())
    # --8<-- [end:fails]
    return train(model, ds_config)  # never reached: the build above raises


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # never reached: main() raises (the ending of every example)
    os._exit(0)  # never reached
