"""Changing a weight FSDP shards, between training steps: half of the head's entries set to
zero (as pruning does; pytorch/pytorch#107081 lost a change this way), under FSDP1's
summon_full_params with its options and under FSDP2 (full_tensor(), unshard(), an in-place
op on the DTensor). Which changes are kept, which are lost without a word, which raise;
1 step before, 2 after.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp_weight_writes.py
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
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import distribute_tensor

VOCAB, DIM, SEQ, BATCH, SEED, LR, STEPS = 16, 8, 6, 8, 0, 0.5, 3


def this_ranks_device():
    """The CPU here (then gloo); with an accelerator (not run here), LOCAL_RANK's."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type,
                            torch.accelerator.current_device_index())
    return torch.device("cpu")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden):
        return hidden + torch.tanh(self.linear(hidden))


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def pruned():
    """The entries to set to zero: every other one."""
    return torch.arange(VOCAB * DIM).reshape(VOCAB, DIM) % 2 == 0


# --8<-- [start:writes]
def write(how, wrapped, model, mask):
    """Set the head's masked entries to zero, the way `how` says."""
    if how.startswith("summon_full_params"):
        options = {"summon_full_params(writeback=False)": {"writeback": False},
                   "summon_full_params(rank0_only=True)": {"rank0_only": True},
                   "summon_full_params(offload_to_cpu=True)": {"offload_to_cpu": True},
                   }.get(how, {})  # writeback=True is the default
        with FSDP.summon_full_params(wrapped, **options):
            if how.endswith(", .data assigned"):
                model.head.weight.data = model.head.weight.data.masked_fill(mask, 0.0)
            else:
                with torch.no_grad():
                    model.head.weight.masked_fill_(mask, 0.0)
    elif how == "full_tensor(), masked_fill_":
        with torch.no_grad():
            model.head.weight.full_tensor().masked_fill_(mask, 0.0)
    elif how == "unshard(), masked_fill_, reshard()":
        model.unshard()  # the root's parameters, gathered and registered
        with torch.no_grad():
            model.head.weight.masked_fill_(mask, 0.0)
        model.reshard()
    else:  # "masked_fill_ on the DTensor, the mask distributed like it"
        weight = model.head.weight
        shard = distribute_tensor(mask, weight.device_mesh, weight.placements)
        with torch.no_grad():
            weight.masked_fill_(shard, 0.0)
# --8<-- [end:writes]


def wrap(way, model, device):
    if way.startswith("FSDP1"):
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device,
                    use_orig_params="use_orig_params=True" in way)
    for block in model.blocks:  # FSDP2: a group per block, the rest in the root's
        fully_shard(block)
    fully_shard(model)
    return model


def full_weights(wrapped, model):
    """Every weight as one process would hold it: gathered, by its name in the plain model."""
    if isinstance(wrapped, FSDP):
        with FSDP.summon_full_params(wrapped, writeback=False):
            return {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for name, p in model.named_parameters()}
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


# --8<-- [start:train]
def train(way, how, device):
    torch.manual_seed(SEED)
    model = LanguageModel().to(device)
    wrapped = wrap(way, model, device)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = (t.to(device) for t in batch())
    mine = slice(rank, None, world)  # data parallel: each rank trains on its share
    losses, zeros = [], None
    for step in range(STEPS):
        if step == 1:  # after the first step, the change
            try:
                write(how, wrapped, model, pruned().to(device))
            except (RuntimeError, NotImplementedError) as error:
                return {"raised": f"{type(error).__name__}: {error}"}
            head = full_weights(wrapped, model)["head.weight"]
            zeros = (head == 0).float().mean().item()  # 0.5 if the change was kept
        loss = F.cross_entropy(wrapped(tokens[mine]).reshape(-1, VOCAB),
                               targets[mine].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / world)
    return {"zeros": zeros, "losses": losses, "weights": full_weights(wrapped, model)}
# --8<-- [end:train]


CASES = [
    ("FSDP1", "summon_full_params(writeback=False)"),
    ("FSDP1", "summon_full_params()"),
    ("FSDP1", "summon_full_params(), .data assigned"),
    ("FSDP1", "summon_full_params(rank0_only=True)"),
    ("FSDP1", "summon_full_params(offload_to_cpu=True)"),
    ("FSDP1, use_orig_params=True", "summon_full_params()"),
    ("FSDP2", "full_tensor(), masked_fill_"),
    ("FSDP2", "unshard(), masked_fill_, reshard()"),
    ("FSDP2", "masked_fill_ on the DTensor, the mask distributed like it"),
]


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    if BATCH % dist.get_world_size():  # unequal shares would weigh samples unequally
        raise ValueError(f"{BATCH} samples do not split evenly over "
                         f"{dist.get_world_size()} ranks; run on 2 or 4 ranks")
    results = {case: train(*case, device) for case in CASES}
    if dist.get_rank() == 0:
        for (way, how), got in results.items():
            print(f"{way}; {how}:")
            if "raised" in got:
                print(f"  {got['raised']}")
                continue
            print(f"  zeros in head.weight after the change {got['zeros']:.2f}; losses "
                  + ", ".join(f"{loss:.4f}" for loss in got["losses"]))
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
