"""Gradient clipping with a hand-kept tie on 2 torch.distributed.pipelining stages: clipping
each stage on its own, and clipping by the whole model's norm with the tie counted once.

Run on CPU (2 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/torch_tied_clip.py
(DS_ACCELERATOR is not used here; the command is the same as for the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm

VOCAB, DIM, SEQ, SEED, LR, CLIP = 16, 8, 6, 0, 0.5, 0.1
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 3


def this_ranks_device():
    """Where this rank computes: the CPU here (then gloo). With an accelerator, e.g. GPUs (not
    run here), the one torchrun's LOCAL_RANK names (then its backend, e.g. NCCL)."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


class TiedLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer1 = nn.Linear(DIM, DIM)
        self.mixer2 = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer1(self.embed(tokens)))
        hidden = torch.tanh(self.mixer2(hidden))
        return self.head(hidden)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:clip]
def clip_whole_model(parameters, tied, first_holder):
    """Clip by the norm of the whole model, as clip_grad_norm_ does in one process: each
    stage's sum of squares, the tied gradient (already summed) counted on one stage only."""
    grads = [p.grad for p in parameters
             if p.grad is not None and (first_holder or p is not tied)]
    squares = get_total_norm(grads) ** 2
    dist.all_reduce(squares)  # over the pipeline: here every rank
    total = squares.sqrt()
    clip_grads_with_norm_(parameters, CLIP, total)
    return total


def clip_each_stage(parameters):
    """The tempting mistake: clip_grad_norm_ on each stage's own parameters."""
    return clip_grad_norm_(parameters, CLIP)
# --8<-- [end:clip]


def train(whole_model, device):
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    tokens, targets = (t.to(device) for t in batch())
    pipe = pipeline(TiedLanguageModel().to(device), mb_args=(tokens[:MICRO_BATCH],),
                    split_spec={"mixer2": SplitPoint.BEGINNING})
    module = pipe.get_stage_module(rank)
    schedule = ScheduleGPipe(pipe.build_stage(rank, device), n_microbatches=MICRO_BATCHES,
                             loss_fn=cross_entropy)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    tied = module.get_parameter(pipe.replicated_params[0][f"submod_pp_{rank}"])
    parameters = list(module.parameters())  # stage 0's unused head.weight has no gradient: skipped
    losses, norms = [], []
    # --8<-- [start:step]
    for step in range(STEPS):
        optimizer.zero_grad()
        step_losses = []
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=step_losses)
        dist.all_reduce(tied.grad)  # the tie first: the clipped norm must see the summed gradient
        if whole_model:
            norm = clip_whole_model(parameters, tied, first_holder=rank == 0)
        else:
            norm = clip_each_stage(parameters)
        optimizer.step()
        # --8<-- [end:step]
        loss = torch.stack(step_losses).mean() if step_losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=1)
        losses.append(loss.item())
        stage_norms = [torch.zeros((), device=device) for _ in range(2)]
        dist.all_gather(stage_norms, norm.detach().reshape(()))
        norms.append([n.item() for n in stage_norms])
    copies = [torch.empty_like(tied) for _ in range(2)]
    dist.all_gather(copies, tied.detach().contiguous())
    return {"losses": losses, "norms": norms, "weight": tied.detach().clone(),
            "copies_equal": torch.equal(copies[0], copies[1]),
            "parameters": {name: p.detach().clone() for name, p in module.named_parameters()}}


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    results = {}
    for whole_model in (True, False):
        result = results["whole model" if whole_model else "each stage"] = train(whole_model, device)
        if dist.get_rank() == 0:
            print("clip by the whole model's norm" if whole_model else "clip_grad_norm_ on each stage")
            for step, (loss, (norm0, norm1)) in enumerate(zip(result["losses"], result["norms"])):
                print(f"  step {step}: loss {loss:.4f}, norm clipped on stage 0 {norm0:.4f}, on stage 1 {norm1:.4f}")
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
