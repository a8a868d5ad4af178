"""Ask DeepSpeed for ZeRO-3 and pipeline parallelism together.

Run on CPU (2 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/zero3_pipeline.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

VOCAB, DIM = 16, 8


def logits_from_embedding(embedding, hidden):  # never reached: initialize raises first
    return hidden @ embedding.weight.t()


def main():
    # --8<-- [start:main]
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    model = PipelineModule(
        [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
         LayerSpec(nn.Linear, DIM, DIM),
         TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=logits_from_embedding)],
        num_stages=2,
        loss_fn=lambda logits, targets: F.cross_entropy(logits.reshape(-1, VOCAB),
                                                        targets.reshape(-1)),
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)  # raises
    # --8<-- [end:main]
    torch.distributed.destroy_process_group()  # never reached: initialize raises


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # never reached: main() raises (the ending of every example)
    os._exit(0)  # never reached
