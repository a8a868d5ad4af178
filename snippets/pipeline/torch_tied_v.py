"""A V-shaped schedule (ScheduleZBVZeroBubble): 4 stages on 2 ranks, the first and the last stage
on rank 0, so the tied embedding and head are one tensor there. No copy, no all_reduce.

Run on CPU (2 processes, 2 stages each):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/torch_tied_v.py
(DS_ACCELERATOR is not used here; the command is the same as for the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

VOCAB, DIM, SEQ, SEED, LR = 16, 8, 6, 0, 0.5
MICRO_BATCH, MICRO_BATCHES, STEPS, STAGES = 4, 4, 3, 4


def this_ranks_device():
    """Where this rank computes: the CPU here (then gloo). With an accelerator, e.g. GPUs (not
    run here), the one torchrun's LOCAL_RANK names (then its backend, e.g. NCCL)."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


# --8<-- [start:model]
class Embed(nn.Module):  # stage 0
    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, tokens):
        return self.embedding(tokens)


class Mixer(nn.Module):  # stages 1 and 2
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden):
        return torch.tanh(self.linear(hidden))


class Head(nn.Module):  # stage 3: the embedding's weight, not a copy of it
    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding

    def forward(self, hidden):
        return hidden @ self.embedding.weight.t()


def build_model():
    """The whole model, in one process: one embedding, used by the first and the last stage."""
    torch.manual_seed(SEED)
    embedding = nn.Embedding(VOCAB, DIM)
    return [Embed(embedding), Mixer(), Mixer(), Head(embedding)]
# --8<-- [end:model]


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def tensor_bytes(tensors):
    """Bytes of the distinct storages among `tensors` (a tensor held twice counts once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def main():
    # --8<-- [start:train]
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank builds all of it, seeded, and keeps its stages.
    layers = [layer.to(device) for layer in build_model()]
    # The V: rank r runs stage r and stage STAGES - 1 - r. Rank 0: stages 0 and 3.
    mine = [rank, STAGES - 1 - rank]
    stages = [PipelineStage(layers[i], i, STAGES, device) for i in mine]
    # scale_grads=False: the schedule would divide each stage's gradients by MICRO_BATCHES, and
    # rank 0's two stages share the embedding, so its gradient would be divided twice.
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=MICRO_BATCHES, loss_fn=cross_entropy,
                                     scale_grads=False)
    # Each parameter once.
    parameters = list({id(p): p for i in mine for p in layers[i].parameters()}.values())
    optimizer = torch.optim.SGD(parameters, lr=LR)

    tokens, targets = (t.to(device) for t in batch())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        step_losses = []
        schedule.step(tokens, target=targets, losses=step_losses) if rank == 0 else schedule.step()
        for p in parameters:  # the mean over micro-batches, once per tensor
            p.grad /= MICRO_BATCHES
        optimizer.step()  # no all_reduce: the embedding's gradient is already whole on rank 0
        loss = torch.stack(step_losses).mean() if step_losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=0)  # the last stage, and so the loss, is on rank 0
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    # --8<-- [end:train]
    # --8<-- [start:check]
    first, last = layers[mine[0]], layers[mine[1]]
    one_tensor = rank == 0 and first.embedding.weight is last.embedding.weight
    held = torch.tensor([tensor_bytes(p for p in parameters), len(parameters)], device=device)
    everyone = [torch.zeros_like(held) for _ in range(world)]
    dist.all_gather(everyone, held)
    if rank == 0:
        print(f"rank 0 runs stages {mine}; the embedding of stage 0 and the head of stage 3 "
              f"are one tensor: {one_tensor}")
        for r, (nbytes, count) in enumerate(e.tolist() for e in everyone):
            print(f"rank {r}: {count} parameters, {nbytes} bytes of parameter storage")
    # --8<-- [end:check]
    result = {"losses": losses, "one_tensor": one_tensor, "mine": mine,
              "parameters": {f"{i}.{name}": p.detach().clone() for i in mine for name, p in layers[i].named_parameters()},
              "bytes": [e.tolist() for e in everyone]}
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
