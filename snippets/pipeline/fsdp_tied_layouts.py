"""The tied model under FSDP1 (FullyShardedDataParallel) and FSDP2 (fully_shard): which
wrapping layouts keep the tie, and what FSDP1 does with the owners in separate units.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp_tied_layouts.py
(DS_ACCELERATOR is not used here; the command is that of the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard

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
    """The wrapped model; `model` keeps its submodules (FSDP1 wraps them in place)."""
    if layout == "FSDP1, one unit (the root)":
        return FSDP(model, device_id=device)
    if layout == "FSDP1, mixer apart, tie in the root":
        model.mixer = FSDP(model.mixer, device_id=device)
        return FSDP(model, device_id=device)
    if layout == "FSDP1, embed and head in separate units":
        model.embed = FSDP(model.embed, device_id=device)
        model.head = FSDP(model.head, device_id=device)
        return FSDP(model, device_id=device)
    if layout == "FSDP2, one group (the root)":
        return fully_shard(model)
    if layout == "FSDP2, mixer apart, tie in the root":
        fully_shard(model.mixer)
        return fully_shard(model)
    raise ValueError(layout)  # pragma: no cover (a layout this file does not define)
# --8<-- [end:layouts]


LAYOUTS = ["FSDP1, one unit (the root)", "FSDP1, mixer apart, tie in the root",
           "FSDP1, embed and head in separate units", "FSDP2, one group (the root)",
           "FSDP2, mixer apart, tie in the root"]


def embedding_and_head(layout, wrapped, model):
    """Full copies of the embedding's and the head's weight, on every rank."""
    if layout.startswith("FSDP1"):
        with FSDP.summon_full_params(wrapped):
            embed, head = model.embed.weight, model.head.weight
            return embed.detach().clone(), head.detach().clone()
    return (model.embed.weight.full_tensor().detach().clone(),
            model.head.weight.full_tensor().detach().clone())


# --8<-- [start:train]
def train(layout, device):
    torch.manual_seed(SEED)
    model = TiedLanguageModel().to(device)
    wrapped = wrap(layout, model, device)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 ranks (the printed losses were checked there)")
    tokens, targets = (t.to(device) for t in batch())
    mine = slice(rank, None, world)  # data parallel: each rank trains on its share
    losses, gaps = [], []
    for step in range(STEPS):
        logits = wrapped(tokens[mine])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[mine].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / world)
        embed, head = embedding_and_head(layout, wrapped, model)
        gaps.append((embed - head).abs().max().item())  # 0.0 while the tie holds
    return {"losses": losses, "gaps": gaps, "embed": embed, "head": head}


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    results = {}
    for layout in LAYOUTS:
        with warnings.catch_warnings(record=True) as caught:  # what each layout warns about
            warnings.simplefilter("always")
            results[layout] = train(layout, device)
        results[layout]["warnings"] = sorted({str(w.message) for w in caught})
    if dist.get_rank() == 0:
        for layout, got in results.items():
            print(f"{layout}:")
            for step, (loss, gap) in enumerate(zip(got["losses"], got["gaps"])):
                print(f"  step {step}: loss {loss:.4f}, "
                      f"max |embed.weight - head.weight| {gap:.4f}")
    dist.destroy_process_group()
    return results
# --8<-- [end:train]


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
