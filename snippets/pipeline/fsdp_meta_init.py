"""A tied model built on the meta device, sharded with FSDP2 (fully_shard), materialized
with to_empty() and filled from a full state dict that rank 0 broadcasts: in which order the tie
survives, what unties it silently, and what ties it again.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp_meta_init.py
(DS_ACCELERATOR is not used here; the command is that of the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, set_model_state_dict)
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


def pretrained():
    """The weights to start from: the model built in one process, seeded."""
    torch.manual_seed(SEED)
    return TiedLanguageModel().state_dict()  # both keys: embed.weight, head.weight


# --8<-- [start:orders]
def materialize(order, device):
    with torch.device("meta"):
        model = TiedLanguageModel()  # still tied: one meta Parameter
    if order == "fully_shard, then to_empty":
        fully_shard(model)
        model.to_empty(device=device)
    elif order == "to_empty, then fully_shard":
        model.to_empty(device=device)  # a new Parameter per module: untied
        fully_shard(model)
    elif order == "to_empty, tie again, then fully_shard":
        model.to_empty(device=device)
        model.head.weight = model.embed.weight  # what tie_weights() does
        fully_shard(model)
    return model


def fill(model, state, strict=True):
    """Rank 0 holds the full state dict; every rank receives its shards."""
    options = StateDictOptions(full_state_dict=True,
                               broadcast_from_rank0=True, strict=strict)
    mine = state if dist.get_rank() == 0 else {}
    return set_model_state_dict(model, mine, options=options)
# --8<-- [end:orders]


ORDERS = ["fully_shard, then to_empty", "to_empty, then fully_shard",
          "to_empty, tie again, then fully_shard"]


def local(param):
    return param.to_local()


# --8<-- [start:train]
def train(model, device):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked there)")
    tokens, targets = (t.to(device) for t in batch())
    mine = slice(rank, None, world)  # data parallel: each rank trains on its share
    steps = []
    for _ in range(STEPS):
        logits = model(tokens[mine])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[mine].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        embed, head = model.embed.weight, model.head.weight
        steps.append({
            "loss": mean.item() / world,
            "one Parameter": head is embed,
            "one storage": local(head).data_ptr() == local(embed).data_ptr(),
            "gap": (embed.full_tensor() - head.full_tensor()).abs().max().item()})
    return {"steps": steps, "embed": model.embed.weight.full_tensor().detach(),
            "head": model.head.weight.full_tensor().detach()}
# --8<-- [end:train]


# --8<-- [start:without_head]
def without_the_heads_key(device):
    """A checkpoint that stores the tied weight once, as save_pretrained
    writes a tied model: no head.weight."""
    def state():  # a new dict per load: set_model_state_dict writes into it
        return {k: v for k, v in pretrained().items() if k != "head.weight"}
    tied = materialize("fully_shard, then to_empty", device)
    try:
        fill(tied, state())  # strict: the head's name is missing
    except RuntimeError as error:
        refused = str(error)
    untied = materialize("to_empty, then fully_shard", device)
    torch.manual_seed(SEED)
    for module in (untied.embed, untied.mixer, untied.head):
        module.reset_parameters()  # initialize, then load over it
    loaded = fill(untied, state(), strict=False)
    return refused, str(loaded), train(untied, device)
# --8<-- [end:without_head]


GROUPS = {"the root": [], "the mixer apart": ["mixer"],
          "embed and head in one group": [("embed", "head")]}


def every_group_layout():
    """Beyond the page: both orders with the tie in other FSDP2 groups, 3 steps each."""
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    results = {}
    for layout, groups in GROUPS.items():
        for shard_first in (True, False):
            with torch.device("meta"):
                model = TiedLanguageModel()
            if not shard_first:
                model.to_empty(device=device)
            for group in groups:
                names = group if isinstance(group, tuple) else (group,)
                fully_shard([getattr(model, name) for name in names])
            fully_shard(model)
            if shard_first:
                model.to_empty(device=device)
            fill(model, pretrained())
            results[layout, shard_first] = train(model, device)
    dist.destroy_process_group()
    return results


def report(name, got):
    print(f"{name}:")
    for step, s in enumerate(got["steps"]):
        print(f"  step {step}: loss {s['loss']:.4f}, head is embed "
              f"{s['one Parameter']}, one storage {s['one storage']}, "
              f"max |embed - head| {s['gap']:.4f}")


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    results = {}
    for order in ORDERS:
        model = materialize(order, device)
        fill(model, pretrained())
        results[order] = train(model, device)
    refused, loaded, results["no head.weight, strict=False"] = (
        without_the_heads_key(device))
    if dist.get_rank() == 0:
        for name, got in results.items():
            report(name, got)
        print(f"strict load without head.weight: RuntimeError: {refused}")
        print(f"strict=False load into the untied model returned: {loaded}")
    dist.destroy_process_group()
    return {"results": results, "refused": refused, "loaded": loaded}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
