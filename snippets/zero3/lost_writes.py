"""nn.Embedding(max_norm=...) under ZeRO-3: its forward renormalises the rows it looks up, in
place, in the weight ZeRO-3 gathered for it. ZeRO-3 frees that tensor when the forward ends
and the optimizer's copy of the weight never saw the change: the write is lost, and the
model trains otherwise than in one process, without an error. The fix renormalises in the
training loop, on both copies ZeRO-3 keeps. Each case trains 3 steps on this rank's share of
every batch; rank 0 also trains the model as written in one process, on the whole batch.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/lost_writes.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from torch import nn

VOCAB, DIM, BATCH, SEQ, STEPS, SEED, LR = 16, 8, 4, 5, 3, 0, 0.5
MAX_NORM = 0.5


def ds_config(world, threshold=0):
    return {
        "train_micro_batch_size_per_gpu": BATCH // world,
        # 0: every parameter partitioned; DeepSpeed's default, 1e5, keeps small ones whole
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }


# --8<-- [start:model]
class Tagger(nn.Module):
    """Token embeddings whose rows are kept at a norm of at most MAX_NORM."""

    def __init__(self, max_norm=MAX_NORM):
        super().__init__()
        # max_norm: every forward renormalises the looked-up rows of the weight, in place
        self.embed = nn.Embedding(VOCAB, DIM, max_norm=max_norm)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.embed(tokens)))
# --8<-- [end:model]


# --8<-- [start:fix]
def renorm_rows(engine, tokens):
    """What nn.Embedding(max_norm=MAX_NORM) does in its forward, done in the training loop
    instead, for the rows of every rank's batch: on the model's copy of the weight (inside
    GatheredParameters with modifier_rank=0) and on the optimizer's copy."""
    everyone = [torch.empty_like(tokens) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, tokens)
    weight = engine.module.embed.weight
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        with torch.no_grad():
            torch.embedding_renorm_(weight, torch.cat(everyone), MAX_NORM, 2.0)
        new = weight.detach().clone()
    deepspeed.utils.safe_set_full_fp32_param(weight, new)


def fixed_step(engine, tokens, targets):
    renorm_rows(engine, tokens)  # the model is Tagger(max_norm=None): its forward writes nothing
    loss = loss_of(engine, tokens, targets)
    engine.backward(loss)
    engine.step()
    return loss
# --8<-- [end:fix]


def make_batch(step, rank=0, world=1):
    """Step `step`'s batch: this rank's consecutive share of it."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    share = BATCH // world
    return tokens[rank * share:(rank + 1) * share], targets[rank * share:(rank + 1) * share]


def loss_of(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def step_as_written(engine, tokens, targets):
    loss = loss_of(engine, tokens, targets)
    engine.backward(loss)
    engine.step()
    return loss


def largest_used_row_norm(weight):
    """The largest norm of a row of the embedding some batch used (max_norm's promise)."""
    used = torch.cat([make_batch(step)[0].flatten() for step in range(STEPS)]).unique()
    return weight.detach()[used].norm(dim=1).max().item()


def full_grad(param):
    grad = safe_get_full_grad(param)
    return torch.zeros(param.ds_shape) if grad is None else grad.clone()


CASES = {  # case: (the model's max_norm, one step, persistence threshold)
    "as written": (MAX_NORM, step_as_written, 0),
    "renormalised in the loop": (None, fixed_step, 0),
    "as written, default persistence threshold": (MAX_NORM, step_as_written, 100000),
}


def train_zero3(case, rank, world):
    """The mean loss over the ranks and the full gradients of each step, and the largest
    norm of a used row of the embedding after the last step."""
    max_norm, step_fn, threshold = CASES[case]
    config = ds_config(world, threshold)
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Tagger(max_norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses, grads = [], []
    for step in range(STEPS):
        loss = step_fn(engine, *make_batch(step, rank, world))
        grads.append({n: full_grad(p) for n, p in engine.module.named_parameters()})
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    with deepspeed.zero.GatheredParameters(engine.module.embed.weight):
        norm = largest_used_row_norm(engine.module.embed.weight)
    return {"losses": losses, "grads": grads, "norm": norm}


def train_plain():
    """Tagger as written, in one process without DeepSpeed, on the whole batch."""
    torch.manual_seed(SEED)
    model = Tagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        loss = loss_of(model, *make_batch(step))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "norm": largest_used_row_norm(model.embed.weight)}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    runs = {case: train_zero3(case, rank, world) for case in CASES}
    runs["one process"] = train_plain()
    if rank == 0:
        for case, run in runs.items():
            print(f"{case}: losses {' '.join(f'{x:.4f}' for x in run['losses'])}, "
                  f"largest norm of a used row {run['norm']:.4f}")
    torch.distributed.destroy_process_group()
    return runs


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
