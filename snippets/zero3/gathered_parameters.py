"""Reading and changing a ZeRO-3 parameter outside forward with deepspeed.zero.GatheredParameters.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/gathered_parameters.py
Run and tested here on CPU only; not run on GPUs.
"""
import contextlib
import logging
import logging.handlers
import os
import sys
import warnings

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEQ, BATCH, SEED, LR = 16, 8, 5, 2, 0, 0.1


# --8<-- [start:model]
class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        # Custom init. Under zero.Init, self.embeddings.weight is already partitioned here
        # (an empty tensor): gather it, change it, and keep rank 0's result on every rank.
        with deepspeed.zero.GatheredParameters(self.embeddings.weight, modifier_rank=0):
            with torch.no_grad():
                self.embeddings.weight.mul_(0.5)
        deepspeed.zero.register_external_parameter(self, self.embeddings.weight)

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer(self.embeddings(tokens)))
        return hidden @ self.embeddings.weight.t()
# --8<-- [end:model]


# --8<-- [start:lost]
def zero_with_modifier_rank_none(weight, rank):
    with deepspeed.zero.GatheredParameters(weight):  # modifier_rank=None, but we change it
        with torch.no_grad():
            weight.zero_()
        inside = weight.sum().item()
    with deepspeed.zero.GatheredParameters(weight):
        after = weight.sum().item()
    print(f"[rank {rank}] zeroed with modifier_rank=None: "
          f"sum {inside:.4f} inside, {after:.4f} after")
    return inside, after
# --8<-- [end:lost]


@contextlib.contextmanager
def recorded_log_warnings():
    """Keeps the log records of level WARNING and above (DeepSpeed's logger does not propagate)."""
    handler = logging.handlers.BufferingHandler(capacity=10_000)
    handler.setLevel(logging.WARNING)
    loggers = (logging.getLogger(), deepspeed.utils.logger)
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.buffer
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def make_batch():
    """The same batch on every rank, so the gradient equals the one-process gradient."""
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    ds_config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LanguageModel()
    seen = {}

    # --8<-- [start:outside]
    weight = model.embeddings.weight
    print(f"[rank {rank}] outside forward: shape {tuple(weight.shape)}, "
          f"ds_shape {tuple(weight.ds_shape)}")
    # --8<-- [end:outside]
    seen["outside"] = (tuple(weight.shape), tuple(weight.ds_shape))

    # --8<-- [start:read]
    with deepspeed.zero.GatheredParameters(weight):  # modifier_rank=None: read only
        full = weight.detach().clone()
        print(f"[rank {rank}] inside GatheredParameters: shape {tuple(weight.shape)}, "
              f"sum {full.sum():.4f}")
    print(f"[rank {rank}] after it: shape {tuple(weight.shape)}")
    # --8<-- [end:read]
    seen["full"], seen["after"] = full, tuple(weight.shape)

    # Record every warning while the change is lost: Python's warnings and the log.
    with warnings.catch_warnings(record=True) as caught, recorded_log_warnings() as logged:
        warnings.simplefilter("always")
        seen["lost"] = zero_with_modifier_rank_none(weight, rank)
    seen["lost_warnings"] = [str(w.message) for w in caught] + [record.getMessage() for record in logged]

    # One training step: the run must equal plain PyTorch with the scaled weight.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    tokens, targets = (t.to(engine.device) for t in make_batch())
    loss = F.cross_entropy(engine(tokens).reshape(-1, VOCAB), targets.reshape(-1))
    engine.backward(loss)
    grads = {name: deepspeed.utils.safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
    if rank == 0:
        print(f"training step: loss {loss.item():.4f}")

    # --8<-- [start:broadcast]
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        with torch.no_grad():
            weight.fill_(rank)  # every rank writes a different value: its rank number
    with deepspeed.zero.GatheredParameters(weight):
        values = weight.unique().tolist()
    print(f"[rank {rank}] each rank wrote its rank under modifier_rank=0; values after: {values}")
    # --8<-- [end:broadcast]
    seen["broadcast"] = (values, tuple(weight.shape))

    # --8<-- [start:guard]
    checked = {**ds_config, "zero_optimization": {**ds_config["zero_optimization"],
                                                  "enable_sanity_checks": True}}
    with deepspeed.zero.Init(config_dict_or_path=checked):
        layer = nn.Linear(DIM, DIM)
    try:
        with deepspeed.zero.GatheredParameters(layer.weight):  # modifier_rank=None again
            with torch.no_grad():
                layer.weight.zero_()
    except RuntimeError as error:
        seen["guard"] = str(error)
        if rank == 0:
            print(f"with enable_sanity_checks: RuntimeError: {error}")
    # --8<-- [end:guard]
    torch.distributed.destroy_process_group()
    return {"loss": loss.item(), "grads": grads, **seen}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
