"""A model around deepspeed.initialize under ZeRO-3: built inside zero.Init and run before
deepspeed.initialize (a preprocessing step, a sanity check), it fails: nothing gathers its
weights yet. Two fixes give the outputs of the same model in one process. Then a layer added
after zero.Init (a new head): a plain parameter until deepspeed.initialize partitions it, and
the training equals the same model's in one process.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/used_before_initialize.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from torch import nn

VOCAB, HIDDEN, SEED, STEPS, LR, BATCH = 16, 8, 0, 3, 0.1, 8
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}


# --8<-- [start:model]
class Encoder(nn.Module):
    """Stands for a vision tower or a text encoder that preprocessing calls."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, tokens):
        hidden = self.body(self.embed(tokens))
        head = getattr(self, "head", None)  # a layer added later, if any
        return hidden if head is None else head(hidden)
# --8<-- [end:model]


def tokens(step=0):
    generator = torch.Generator().manual_seed(SEED + step)
    return torch.randint(0, VOCAB, (BATCH, 6), generator=generator)


def train(engine, device):
    """STEPS steps of next-token SGD, each rank on its share of the batch."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses, grads = [], []
    for step in range(STEPS):
        batch = tokens(step)[rank::world].to(device)
        logits = engine(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        grads.append({name: safe_get_full_grad(p).clone()
                      for name, p in engine.module.named_parameters()})
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "grads": grads}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    device = get_accelerator().current_device_name()
    results = {}

    # --8<-- [start:early]
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = Encoder()  # partitioned: each weight is empty outside a forward
    try:
        model(tokens().to(device))  # preprocessing, before deepspeed.initialize
    except RuntimeError as error:
        results["early"] = f"{type(error).__name__}: {error}"
    # --8<-- [end:early]
    say("run before deepspeed.initialize:", results["early"])

    # --8<-- [start:gathered]
    # Fix 1, where the call must come first: gather every weight it reads, for the call only.
    with deepspeed.zero.GatheredParameters(list(model.parameters())), torch.no_grad():
        results["gathered"] = model(tokens().to(device)).cpu()
    # --8<-- [end:gathered]
    say("inside GatheredParameters: output sum", f"{results['gathered'].sum().item():.4f}")

    # --8<-- [start:engine]
    # Fix 2: run it after deepspeed.initialize, through the engine, which gathers each module.
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    with torch.no_grad():
        results["engine"] = engine(tokens().to(engine.device)).cpu()
    # --8<-- [end:engine]
    say("through the engine: output sum", f"{results['engine'].sum().item():.4f}")

    # --8<-- [start:added]
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = Encoder()
    model.head = nn.Linear(HIDDEN, VOCAB)  # added after zero.Init: not partitioned
    before = (tuple(model.head.weight.shape), hasattr(model.head.weight, "ds_id"))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    after = (tuple(model.head.weight.shape), hasattr(model.head.weight, "ds_id"))
    # --8<-- [end:added]
    results["head"] = {"before": before, "after": after,
                       "ds_shape": tuple(model.head.weight.ds_shape)}
    say(f"head added after zero.Init: shape {before[0]}, ds_id {before[1]}; after "
        f"deepspeed.initialize: shape {after[0]}, ds_id {after[1]}, "
        f"ds_shape {results['head']['ds_shape']}")
    results["training"] = train(engine, engine.device)
    say("trained with the added head, losses:",
        *(f"{x:.4f}" for x in results["training"]["losses"]))
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
