"""A weight sharded with FSDP read outside the forward that gathers it: a method of the model
called directly (`model.module.get_embeds(...)`, as in pytorch/pytorch#124017), and the model
called without its FSDP wrapper (pytorch/pytorch#124019); under FSDP1 with both values of
use_orig_params and under FSDP2 (fully_shard). Then the fixes, each trained 3 steps.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp_outside_forward.py
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
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

VOCAB, DIM, SEQ, BATCH, SEED, LR, STEPS, NOISE = 16, 8, 6, 8, 0, 0.5, 3, 0.1


def this_ranks_device():
    """The CPU here (then gloo); with an accelerator (not run here), LOCAL_RANK's."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type,
                            torch.accelerator.current_device_index())
    return torch.device("cpu")


# --8<-- [start:model]
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

    def get_embeds(self, tokens):  # a method, not a forward
        return self.embed(tokens)

    def forward(self, tokens=None, inputs_embeds=None, noise=None):
        hidden = self.get_embeds(tokens) if inputs_embeds is None else inputs_embeds
        if noise is not None:
            hidden = hidden + noise
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)
# --8<-- [end:model]


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    noise = torch.randn(STEPS, BATCH, SEQ, DIM, generator=generator)  # a draw per step
    return tokens[:, :-1], tokens[:, 1:], noise


# --8<-- [start:wrap]
def wrap(way, model, device):
    if way.startswith("FSDP1"):
        units = {Block, nn.Embedding} if "embedding in a unit" in way else {Block}
        # use_orig_params=False, the default, exposes views into a flat parameter
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(units), device_id=device,
                    use_orig_params="use_orig_params=True" in way)
    for block in model.blocks:  # FSDP2: a group per block, the rest in the root's
        fully_shard(block)
    if "embedding in a group" in way:
        fully_shard(model.embed)  # get_embeds then runs this group's forward
    fully_shard(model)
    if "register_fsdp_forward_method" in way:
        register_fsdp_forward_method(model, "get_embeds")  # FSDP2 gathers around it
    return model
# --8<-- [end:wrap]


METHOD = "get_embeds called directly, then the wrapped model"
UNWRAPPED = "the model without its FSDP wrapper"
WRAPPED = "the wrapped model, the noise passed to its forward"


# --8<-- [start:train]
def train(way, call, device):
    torch.manual_seed(SEED)
    model = LanguageModel().to(device)
    wrapped = wrap(way, model, device)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets, noise = (t.to(device) for t in batch())
    mine = slice(rank, None, world)  # data parallel: each rank trains on its share
    losses = []
    for step in range(STEPS):
        step_noise = NOISE * noise[step][mine]
        try:
            if call == METHOD:
                inner = wrapped.module if isinstance(wrapped, FSDP) else wrapped
                embeds = inner.get_embeds(tokens[mine]) + step_noise
                logits = wrapped(inputs_embeds=embeds)
            elif call == UNWRAPPED:
                logits = model(tokens[mine], noise=step_noise)
            else:  # the fix: one call of the wrapped model's forward
                logits = wrapped(tokens[mine], noise=step_noise)
        except (RuntimeError, AssertionError) as error:
            return {"raised": f"{type(error).__name__}: {error}"}
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[mine].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / world)
    return {"losses": losses, "weights": full_weights(wrapped, model)}
# --8<-- [end:train]


def full_weights(wrapped, model):
    """Every weight as one process would hold it: gathered, by its name in the plain model."""
    if isinstance(wrapped, FSDP):
        with FSDP.summon_full_params(wrapped, writeback=False):
            return {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for name, p in model.named_parameters()}
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


CASES = [  # (way, call): the reader's calls first, then the fixes
    ("FSDP1", METHOD),
    ("FSDP1, use_orig_params=True", METHOD),
    ("FSDP2", METHOD),
    ("FSDP1", UNWRAPPED),
    ("FSDP1, use_orig_params=True", UNWRAPPED),
    ("FSDP1, the embedding in a unit of its own", METHOD),
    ("FSDP2, the embedding in a group of its own", METHOD),
    ("FSDP1", WRAPPED),
    ("FSDP1, use_orig_params=True", WRAPPED),
    ("FSDP2", WRAPPED),
    ("FSDP2, register_fsdp_forward_method(model, 'get_embeds')", METHOD),
]


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    if BATCH % dist.get_world_size():  # unequal shares would weigh samples unequally
        raise ValueError(f"{BATCH} samples do not split evenly over "
                         f"{dist.get_world_size()} ranks; run on 2 or 4 ranks")
    results = {(way, call): train(way, call, device) for way, call in CASES}
    if dist.get_rank() == 0:
        for (way, call), got in results.items():
            print(f"{way}; {call}:")
            if "raised" in got:
                print(f"  {got['raised']}")
                continue
            print("  losses " + ", ".join(f"{loss:.4f}" for loss in got["losses"]))
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
