"""The tied language model on 2 pipeline stages x 2 data-parallel replicas (4 ranks) with DeepSpeed.

Run on CPU (4 processes: 2 stages, each replicated twice):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 snippets/pipeline/deepspeed_tied_dp.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

VOCAB, DIM, SEQ, SEED, LR = 16, 8, 6, 1234, 0.5
MICRO_BATCH, MICRO_BATCHES, STEPS, STAGES = 4, 2, 3, 2


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden):
        return torch.tanh(self.linear(hidden))


def logits_from_embedding(embedding, hidden):
    return hidden @ embedding.weight.t()


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


# --8<-- [start:data]
def micro_batches(replica, device):
    """Replica r's MICRO_BATCHES (tokens, next tokens) pairs: each replica gets other data."""
    generator = torch.Generator().manual_seed(replica)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator).to(device)
        yield tokens[:, :-1], tokens[:, 1:]
# --8<-- [end:data]


def max_difference_between_copies(weight):
    """Largest |copy on any rank - copy on rank 0|: all four copies, both stages, both replicas."""
    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, weight.detach().contiguous())
    return max((copy - copies[0]).abs().max().item() for copy in copies)


def main():
    # --8<-- [start:main]
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = dist.get_rank()
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), LayerSpec(Mixer), LayerSpec(Mixer),
              TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=logits_from_embedding)]
    # 4 ranks, 2 stages: DeepSpeed makes the other dimension data parallelism (2 replicas).
    model = PipelineModule(layers, num_stages=STAGES, loss_fn=cross_entropy,
                           seed_layers=True, base_seed=SEED, partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ds_config = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
                 "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    grid = engine.grid  # who is who: stage and replica of this rank, and its process groups
    stage, replica = grid.get_stage_id(), grid.get_data_parallel_id()
    tie = engine.module.tied_comms["embed"]
    print(f"[rank {rank}] stage {stage}, replica {replica}: "
          f"tie group {tie['ranks']}, data-parallel group {grid.dp_group}")

    weight = engine.module.tied_modules["embed"].weight
    losses, differences = [], []
    for step in range(STEPS):
        losses.append(engine.train_batch(data_iter=micro_batches(replica, engine.device)).item())
        differences.append(max_difference_between_copies(weight))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}, "
                  f"max |copy - rank 0 copy| over all 4 ranks {differences[-1]:.4f}")
    # --8<-- [end:main]
    result = {"losses": losses, "differences": differences, "weight": weight.detach().clone(),
              "stage": stage, "replica": replica, "tie_ranks": tie["ranks"], "dp_group": list(grid.dp_group),
              "parameters": {name: p.detach().clone() for name, p in engine.module.named_parameters()}}
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
