"""Reading the shape of another module's weight in a constructor under deepspeed.zero.Init
(DeepSpeed issue #907): weight.size(1) fails on the partitioned, empty weight; three fixes.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/constructor_shape.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEQ, BATCH, SEED = 16, 8, 5, 2, 0


# --8<-- [start:fails]
def width_from_size(embeddings):
    return embeddings.weight.size(1)  # under zero.Init the weight is already empty here
# --8<-- [end:fails]


# --8<-- [start:fixes]
def width_from_ds_shape(embeddings):
    return embeddings.weight.ds_shape[1]  # the full shape; ds_shape exists under ZeRO-3 only


def width_from_gathered(embeddings):
    with deepspeed.zero.GatheredParameters(embeddings.weight):  # a collective: all ranks run it
        return embeddings.weight.size(1)


def width_from_config(embeddings):
    return embeddings.embedding_dim  # the value the layer was built with
# --8<-- [end:fixes]


# --8<-- [start:model]
class LanguageModel(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        # DeepSpeed issue #907: a head sized from the embedding weight's shape.
        self.head = nn.Linear(width(self.embeddings), VOCAB)

    def forward(self, tokens):
        return self.head(self.embeddings(tokens))
# --8<-- [end:model]


SHOWN = {  # what each way reads, as printed
    "width_from_size": "embeddings.weight.size(1)",
    "width_from_ds_shape": "embeddings.weight.ds_shape[1]",
    "width_from_gathered": "embeddings.weight.size(1) inside GatheredParameters",
    "width_from_config": "embeddings.embedding_dim",
}


def make_batch():
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    seen = {}
    for width in (width_from_size, width_from_ds_shape, width_from_gathered, width_from_config):
        torch.manual_seed(SEED)
        try:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = LanguageModel(width)
        except IndexError as error:
            seen[width.__name__] = f"IndexError: {error}"
            if rank == 0:
                print(f"{SHOWN[width.__name__]}: IndexError: {error}")
            continue
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
        tokens, targets = make_batch()
        logits = engine(tokens.to(engine.device))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.to(engine.device).reshape(-1))
        seen[width.__name__] = (tuple(engine.module.head.weight.ds_shape), loss.item())
        if rank == 0:
            print(f"{SHOWN[width.__name__]}: head.weight ds_shape {tuple(engine.module.head.weight.ds_shape)}, loss {loss.item():.4f}")
    torch.distributed.destroy_process_group()
    return seen


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
