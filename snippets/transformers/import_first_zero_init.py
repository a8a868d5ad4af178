"""Fix 1 for import_inside_zero_init.py: import torch._dynamo before entering
deepspeed.zero.Init. The same model is then built inside the `with` block, partitioned,
and trained under ZeRO-3.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/import_first_zero_init.py
Run and tested here on CPU only; not run on GPUs.
"""
# --8<-- [start:imports]
import os
import sys

import deepspeed
import torch
# Before zero.Init, which replaces torch.Tensor.__new__ while it is active:
import torch._dynamo  # noqa: F401
import transformers
# --8<-- [end:imports]
from deepspeed.accelerator import get_accelerator

from import_inside_zero_init import SEED, tiny_gpt2_config, train, zero3_config


def main():
    backend = get_accelerator().communication_backend_name()  # gloo on CPU
    deepspeed.init_distributed(dist_backend=backend)
    ds_config = zero3_config(torch.distributed.get_world_size())
    torch.manual_seed(SEED)
    # --8<-- [start:build]
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = transformers.AutoModelForCausalLM.from_config(tiny_gpt2_config())
    # --8<-- [end:build]
    return train(model, ds_config)


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
