"""A weight FSDP shards, read in the loss after the forward (a penalty on its squares): what the
loss gets under FSDP1 (both values of use_orig_params) and FSDP2, for a weight of the root unit
and for one of a child unit; then the penalty computed inside the forward of the unit that
owns the weight, and FSDP2's full_tensor(). Each trained 3 steps.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp_weight_in_loss.py
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
from torch.distributed.tensor import DTensor

VOCAB, DIM, SEQ, BATCH, SEED, LR, STEPS, REG = 16, 8, 6, 8, 0, 0.5, 3, 0.05
ROOT, CHILD = "head.weight", "blocks.1.linear.weight"  # owned by the root, by a child unit


def this_ranks_device():
    """The CPU here (then gloo); with an accelerator (not run here), LOCAL_RANK's."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type,
                            torch.accelerator.current_device_index())
    return torch.device("cpu")


def squares(weight):
    return REG * weight.pow(2).sum()


# --8<-- [start:model]
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden, penalty, penalize):
        if penalize:  # this unit's weight, read in this unit's forward
            penalty = penalty + squares(self.linear.weight)
        return hidden + torch.tanh(self.linear(hidden)), penalty


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, penalize=None):
        """The logits, and the penalty on the weight named by `penalize`, if any."""
        penalty = torch.zeros((), device=tokens.device)
        if penalize == ROOT:
            penalty = penalty + squares(self.head.weight)
        hidden = self.embed(tokens)
        for index, block in enumerate(self.blocks):
            own = penalize == CHILD and index == 1
            hidden, penalty = block(hidden, penalty, own)
        return self.head(hidden), penalty
# --8<-- [end:model]


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def wrap(way, model, device):
    if way.startswith("FSDP1"):
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device,
                    use_orig_params="use_orig_params=True" in way)
    for block in model.blocks:  # FSDP2: a group per block, the rest in the root's
        fully_shard(block)
    fully_shard(model)
    return model


def weight(model, name):
    return model.head.weight if name == ROOT else model.blocks[1].linear.weight


# --8<-- [start:seen]
def what_the_loss_reads(way, name, device):
    """After a forward: the tensor a loss gets for the weight, and how many of its
    elements this rank holds in memory."""
    torch.manual_seed(SEED)
    model = LanguageModel().to(device)
    wrapped = wrap(way, model, device)
    wrapped(batch()[0].to(device))
    read = weight(model, name)
    local = read.to_local() if isinstance(read, DTensor) else read
    freed = local.untyped_storage().nbytes() == 0  # a view into memory FSDP freed
    held = 0 if freed else local.numel()
    return f"{type(read).__name__} of shape {tuple(read.shape)}, {held} elements held"
# --8<-- [end:seen]


# --8<-- [start:train]
def train(way, where, name, device):
    torch.manual_seed(SEED)
    model = LanguageModel().to(device)
    wrapped = wrap(way, model, device)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = (t.to(device) for t in batch())
    mine = slice(rank, None, world)  # data parallel: each rank trains on its share
    losses = []
    for _ in range(STEPS):
        if where == "in the loss":
            logits, _ = wrapped(tokens[mine])
            penalty = squares(weight(model, name))
        elif where == "in the loss, of full_tensor()":
            logits, _ = wrapped(tokens[mine])
            penalty = squares(weight(model, name).full_tensor())
        else:  # "in the forward of the unit that owns it"
            logits, penalty = wrapped(tokens[mine], penalize=name)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[mine].reshape(-1))
        loss = loss + penalty
        try:
            loss.backward()
        except RuntimeError as error:
            return {"raised": f"RuntimeError: {error}"}
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / world)  # what the ranks report, averaged
    return {"losses": losses, "weights": full_weights(wrapped, model)}
# --8<-- [end:train]


def full_weights(wrapped, model):
    """Every weight as one process would hold it: gathered, by its name in the plain model."""
    if isinstance(wrapped, FSDP):
        with FSDP.summon_full_params(wrapped, writeback=False):
            return {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for name, p in model.named_parameters()}
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


WAYS = ["FSDP1", "FSDP1, use_orig_params=True", "FSDP2"]
IN_LOSS, FULL, IN_FORWARD = ("in the loss", "in the loss, of full_tensor()",
                             "in the forward of the unit that owns it")
CASES = [  # (way, where the penalty is computed, the weight); FSDP1's child weight in the
    # loss is left out: it holds 0 elements (printed), and reading it is reading freed memory
    ("FSDP1", IN_LOSS, ROOT),
    ("FSDP1, use_orig_params=True", IN_LOSS, ROOT),
    ("FSDP1, use_orig_params=True", IN_LOSS, CHILD),
    ("FSDP2", IN_LOSS, ROOT),
    ("FSDP2", IN_LOSS, CHILD),
    ("FSDP2", FULL, CHILD),
    *[(way, IN_FORWARD, name) for way in WAYS for name in (ROOT, CHILD)],
]


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    if BATCH % dist.get_world_size():  # unequal shares would weigh samples unequally
        raise ValueError(f"{BATCH} samples do not split evenly over "
                         f"{dist.get_world_size()} ranks; run on 2 or 4 ranks")
    seen = {(way, name): what_the_loss_reads(way, name, device)
            for way in WAYS for name in (ROOT, CHILD)}
    results = {case: train(*case, device) for case in CASES}
    if dist.get_rank() == 0:
        print("What a loss reads after the forward, on rank 0:")
        for (way, name), what in seen.items():
            print(f"  {way}, {name}: {what}")
        for (way, where, name), got in results.items():
            print(f"{way}; the penalty on {name} {where}:")
            if "raised" in got:
                print(f"  {got['raised']}")
                continue
            print("  losses " + ", ".join(f"{loss:.4f}" for loss in got["losses"]))
    dist.destroy_process_group()
    return {"seen": seen, "results": results}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
