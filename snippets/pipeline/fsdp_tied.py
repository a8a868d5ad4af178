"""The tied model under FSDP2 (fully_shard): the tie must stay inside one FSDP group.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp_tied.py
(DS_ACCELERATOR is not used here; the command is the same as for the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

VOCAB, DIM, SEQ, BATCH, SEED, LR, STEPS = 16, 8, 6, 8, 0, 0.5, 3


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
        self.mixer = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # the tie: one Parameter, two modules

    def forward(self, tokens):
        return self.head(torch.tanh(self.mixer(self.embed(tokens))))


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:train]
def train(tie_in_one_group, device):
    torch.manual_seed(SEED)
    model = TiedLanguageModel().to(device)
    if tie_in_one_group:
        fully_shard([model.embed, model.head])  # both owners of the tied weight: one group
    else:
        fully_shard(model.embed)  # the two owners in separate groups
        fully_shard(model.head)
    fully_shard(model.mixer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 ranks (the printed losses were checked there)")
    tokens, targets = (t.to(device) for t in batch())
    mine = slice(rank, None, world)  # data parallel: each rank trains on its share of the batch
    losses = []
    for step in range(STEPS):
        # The separate-groups model raises here, at its first forward.
        logits = model(tokens[mine])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[mine].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
    return losses, model.embed.weight.full_tensor().detach().clone()


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    train(tie_in_one_group=True, device=device)
    train(tie_in_one_group=False, device=device)  # raises ValueError
    dist.destroy_process_group()  # never reached: the line above raises
# --8<-- [end:train]


def tie_in_one_group():
    """What the tests compare with one process: the working variant alone."""
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    result = train(tie_in_one_group=True, device=device)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # never reached: main() raises (the ending of every example)
    os._exit(0)  # never reached
