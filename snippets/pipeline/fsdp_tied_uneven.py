"""A tied weight whose rows the ranks do not divide, under FSDP2 (fully_shard) with both of its
owners in one group: pytorch/pytorch issue #176076 reports that with the owners in separate
groups and such uneven shards, the last rank's rows never update. Trained 3 steps; whether each
rank's shard of the weight changed, and the weight against the same model in one process.

Run on CPU (2 or 4 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp_tied_uneven.py
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

VOCAB, DIM, SEQ, BATCH, SEED, LR, STEPS = 15, 8, 6, 8, 0, 0.5, 3  # 15 rows: 8 + 7 on 2 ranks


def this_ranks_device():
    """The CPU here (then gloo); with an accelerator (not run here), torchrun's LOCAL_RANK's."""
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


# --8<-- [start:train]
def train(device, separate_groups=False):
    torch.manual_seed(SEED)
    model = TiedLanguageModel().to(device)
    start = model.embed.weight.detach().clone()
    if separate_groups:  # pragma: no cover - torch 2.11 (versions/); 2.12+ refuse it
        fully_shard(model.embed)
        fully_shard(model.head)
    else:
        fully_shard([model.embed, model.head])  # the tie in one group
    fully_shard(model.mixer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = (t.to(device) for t in batch())
    losses = []
    for _ in range(STEPS):
        logits = model(tokens[rank::world])  # this rank's share of the batch
        loss = F.cross_entropy(logits.reshape(-1, VOCAB),
                               targets[rank::world].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / world)
    weight = model.embed.weight.full_tensor().detach()
    # FSDP2 gives rank r the r-th of `world` chunks of the rows (the last is shorter)
    shards = torch.arange(VOCAB).chunk(world)
    changed = [bool((weight[rows] != start[rows].to(device)).any(dim=1).all())
               for rows in shards]
    return {"losses": losses, "weight": weight.cpu(), "rows": [len(r) for r in shards],
            "every row of the shard changed": changed,
            "head": model.head.weight.full_tensor().detach().cpu()}
# --8<-- [end:train]


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    world = dist.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    result = train(device)
    if dist.get_rank() == 0:
        print(f"{VOCAB} rows over {world} ranks: {result['rows']}; embed and head in one group")
        print("losses " + " ".join(f"{x:.4f}" for x in result["losses"]))
        print(f"every row of each rank's shard changed: {result['every row of the shard changed']}")
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
