"""The other arguments of deepspeed.zero.GatheredParameters, checked: a list of parameters,
enabled=False, things that are not parameters, what modifier_rank=None leaves behind, and
fwd_module= (whose registration outlives the with block). Also where unregister_external_parameter lives.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/gathered_parameters_api.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import unregister_external_parameter
from torch import nn

VOCAB, DIM, SEQ, BATCH, SEED = 16, 8, 5, 2, 0


class ListHead(nn.Module):
    """Reads the embedding weight through a list: automatic detection does not see that read."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.tied = [self.embeddings.weight]

    def forward(self, tokens):
        return self.embeddings(tokens) @ self.tied[0].t()


def shapes(params):
    return [tuple(p.shape) for p in params]


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
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        layer = nn.Linear(DIM, 4)
        model = ListHead()
    seen = {}
    # --8<-- [start:list]
    with deepspeed.zero.GatheredParameters(list(layer.parameters())):  # several at once
        seen["list"] = shapes(layer.parameters())
    with deepspeed.zero.GatheredParameters(layer.weight, enabled=False):  # does nothing
        seen["enabled=False"] = shapes([layer.weight])
    with deepspeed.zero.GatheredParameters(layer):  # a module is not a parameter: ignored
        seen["a module"] = shapes([layer.weight])
    # --8<-- [end:list]
    # --8<-- [start:released]
    with deepspeed.zero.GatheredParameters(layer.weight):  # modifier_rank=None
        pass
    seen["after modifier_rank=None"] = (tuple(layer.weight.shape), layer.weight.ds_status.name,
                                        layer.weight.data.numel())
    # --8<-- [end:released]
    if rank == 0:
        for what, value in seen.items():
            print(f"{what}: {value}")

    # --8<-- [start:fwd_module]
    weight = model.embeddings.weight
    with deepspeed.zero.GatheredParameters(weight, fwd_module=model):
        pass  # nothing done in the block: only the registration it made stays
    registered = [p is weight for _, p in model.ds_external_parameters()]
    # --8<-- [end:fwd_module]
    seen["registered after the block"] = registered
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    tokens, targets = make_batch()
    loss = F.cross_entropy(engine(tokens.to(engine.device)).reshape(-1, VOCAB), targets.to(engine.device).reshape(-1))
    seen["loss"] = loss.item()
    if rank == 0:
        print(f"registered on the model after the with block: {registered}; forward through the list: loss {loss.item():.4f}")

    # --8<-- [start:unregister]
    exported = hasattr(deepspeed.zero, "unregister_external_parameter")  # documented there
    unregister_external_parameter(model, weight)  # from deepspeed.runtime.zero.partition_parameters
    # --8<-- [end:unregister]
    seen["exported"] = exported
    seen["registered after unregister"] = [p is weight for _, p in model.ds_external_parameters()]
    if rank == 0:
        print(f"hasattr(deepspeed.zero, 'unregister_external_parameter'): {exported}; "
              f"registered after unregister_external_parameter: {seen['registered after unregister']}")
    torch.distributed.destroy_process_group()
    return seen


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
