"""FSDP1 (FullyShardedDataParallel) with the tied weight's two owners in separate units:
wrapping accepts every layout here; with use_orig_params=True the first forward raises, with
the default use_orig_params=False an auto-wrap policy trains two weights without a word.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp1_shared_units.py
(DS_ACCELERATOR is not used here; the command is that of the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

VOCAB, DIM, SEQ, BATCH, SEED, LR, STEPS = 16, 8, 6, 8, 0, 0.5, 3


def this_ranks_device():
    """The CPU here (then gloo); with an accelerator (not run here), LOCAL_RANK's."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type,
                            torch.accelerator.current_device_index())
    return torch.device("cpu")


class TiedLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # the tie: one Parameter, two modules

    def forward(self, tokens):
        return self.head(torch.tanh(self.mixer(self.embed(tokens))))


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:layouts]
def wrap(layout, model, device):
    if layout == "embed in a unit of its own, use_orig_params=True":
        model.embed = FSDP(model.embed, device_id=device, use_orig_params=True)
        return FSDP(model, device_id=device, use_orig_params=True)
    if layout == "head in a unit of its own, use_orig_params=True":
        model.head = FSDP(model.head, device_id=device, use_orig_params=True)
        return FSDP(model, device_id=device, use_orig_params=True)
    if layout == "auto_wrap_policy=ModuleWrapPolicy({nn.Embedding})":
        policy = ModuleWrapPolicy({nn.Embedding})  # the embedding: a unit
        return FSDP(model, device_id=device, auto_wrap_policy=policy)
    raise ValueError(layout)  # pragma: no cover (a layout this file does not define)
# --8<-- [end:layouts]


LAYOUTS = ["embed in a unit of its own, use_orig_params=True",
           "head in a unit of its own, use_orig_params=True",
           "auto_wrap_policy=ModuleWrapPolicy({nn.Embedding})"]


# --8<-- [start:train]
def train(layout, device):
    torch.manual_seed(SEED)
    model = TiedLanguageModel().to(device)
    wrapped = wrap(layout, model, device)  # no layout raises here
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked there)")
    tokens, targets = (t.to(device) for t in batch())
    mine = slice(rank, None, world)  # data parallel: each rank trains on its share
    losses, gaps = [], []
    for _ in range(STEPS):
        try:
            logits = wrapped(tokens[mine])
        except RuntimeError as error:  # in the forward of the module that reads
            return {"raised": f"RuntimeError: {error}"}  # the other unit's shard
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[mine].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / world)
        with FSDP.summon_full_params(wrapped):
            gaps.append((model.embed.weight - model.head.weight).abs().max().item())
    return {"losses": losses, "gaps": gaps}
# --8<-- [end:train]


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    results = {layout: train(layout, device) for layout in LAYOUTS}
    if dist.get_rank() == 0:
        for layout, got in results.items():
            print(f"{layout}:")
            if "raised" in got:
                print(f"  wrapped; the first forward raised {got['raised']}")
                continue
            for step, (loss, gap) in enumerate(zip(got["losses"], got["gaps"])):
                print(f"  step {step}: loss {loss:.4f}, "
                      f"max |embed.weight - head.weight| {gap:.4f}")
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
