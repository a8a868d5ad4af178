"""Fix 2 for import_inside_zero_init.py: no `with deepspeed.zero.Init()` of your own.
While an HfDeepSpeedConfig holding a ZeRO-3 config exists, from_config builds the model
inside zero.Init itself, after it has imported the model's module. Then trained.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/hf_config_zero_init.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from transformers.integrations import HfDeepSpeedConfig

from import_inside_zero_init import SEED, tiny_gpt2_config, train, zero3_config


def main():
    backend = get_accelerator().communication_backend_name()  # gloo on CPU
    deepspeed.init_distributed(dist_backend=backend)
    ds_config = zero3_config(torch.distributed.get_world_size())
    torch.manual_seed(SEED)
    # --8<-- [start:build]
    # Keep the object alive until the model is built: from_config looks it up
    # (through a weak reference) to decide to build under zero.Init.
    zero3 = HfDeepSpeedConfig(ds_config)
    model = transformers.AutoModelForCausalLM.from_config(tiny_gpt2_config())
    # --8<-- [end:build]
    result = train(model, ds_config)
    del zero3
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
