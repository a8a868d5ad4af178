"""The same tied language model on 2 pipeline stages with torch.distributed.pipelining, no DeepSpeed.

Run on CPU (2 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/torch_tied.py
(DS_ACCELERATOR is not used here; the command is the same as for the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

VOCAB, DIM, SEQ, SEED, LR = 16, 8, 6, 0, 0.5
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 4


def this_ranks_device():
    """Where this rank computes: the CPU here (then gloo). With an accelerator, e.g. GPUs (not
    run here), the one torchrun's LOCAL_RANK names (then its backend, e.g. NCCL)."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


# --8<-- [start:model]
class TiedLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer1 = nn.Linear(DIM, DIM)
        self.mixer2 = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # the tie: one Parameter, two modules

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer1(self.embed(tokens)))
        hidden = torch.tanh(self.mixer2(hidden))
        return self.head(hidden)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
# --8<-- [end:model]


def batch():
    """MICRO_BATCHES * MICRO_BATCH sequences: the same on every rank, every step, every run."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:split]
def split(model, tokens):
    """Cut the model before mixer2; every rank traces the whole model and keeps its stage."""
    # Show pipelining's note about parameters used on several stages (INFO, on stderr).
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.INFO)
    pipe = pipeline(model, mb_args=(tokens[:MICRO_BATCH],),
                    split_spec={"mixer2": SplitPoint.BEGINNING})
    # pipe.replicated_params: one {stage submodule: parameter name} dict per shared weight,
    # e.g. {"submod_pp_0": "embed.weight", "submod_pp_1": "head.weight"}.
    (uses,) = pipe.replicated_params
    # Stage = rank here.
    holders = sorted(int(submodule.rsplit("_", 1)[1]) for submodule in uses)
    return pipe, uses, holders
# --8<-- [end:split]


def main():
    # --8<-- [start:train]
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    tokens, targets = (t.to(device) for t in batch())
    pipe, uses, holders = split(TiedLanguageModel().to(device), tokens)
    module = pipe.get_stage_module(rank)
    stage = pipe.build_stage(rank, device)
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, loss_fn=cross_entropy)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)

    # The tie, kept by hand: a group of the stages holding a copy, equal copies at the start...
    tie_group = dist.new_group(holders)  # every rank calls new_group, members or not
    tied = module.get_parameter(uses[f"submod_pp_{rank}"]) if rank in holders else None
    if tied is not None:
        dist.broadcast(tied.data, src=holders[0], group=tie_group)

    losses, partial_grads = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        step_losses = []
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=step_losses)
        if tied is not None:
            partial_grads.append(tied.grad.clone())  # this stage's share only
            # ...and one gradient for both copies: the sum of the stages' shares.
            dist.all_reduce(tied.grad, op=dist.ReduceOp.SUM, group=tie_group)
        optimizer.step()
        loss = torch.stack(step_losses).mean() if step_losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=pipe.num_stages - 1)  # the last stage has the loss
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    # --8<-- [end:train]
    copies = [torch.empty_like(tied) for _ in holders]
    dist.all_gather(copies, tied.detach().contiguous(), group=tie_group)
    shares = [torch.empty_like(tied) for _ in holders]
    dist.all_gather(shares, partial_grads[0], group=tie_group)
    if rank == 0:
        print(f"copies of the tied weight: {sorted(uses.items())}")
        print(f"max |stage 0 copy - stage 1 copy| after {STEPS} steps: "
              f"{(copies[0] - copies[1]).abs().max().item():.4f}")
        norms = ", ".join(f"stage {s} {g.norm().item():.4f}" for s, g in zip(holders, shares))
        print(f"step 0, norm of each stage's share of the tied gradient: {norms}; "
              f"of their sum {sum(shares).norm().item():.4f}")
    dist.destroy_process_group()
    return {"losses": losses, "holders": holders, "uses": dict(uses), "weight": tied.detach().clone(),
            "copies": copies, "first_shares": shares,
            "parameter_names": [name for name, _ in module.named_parameters()],
            "unused_grads": [name for name, p in module.named_parameters() if p.grad is None]}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
