"""The tied language model on DeepSpeed pipeline stages with ZeRO-1, bf16, and both.

Run on CPU (4 processes: 2 stages x 2 data-parallel replicas, so that ZeRO-1 has a
data-parallel group to partition over):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 snippets/pipeline/deepspeed_tied_bf16.py
Run and tested here on CPU only; not run on GPUs.
"""
import contextlib
import io
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.utils import safe_get_full_fp32_param
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


def micro_batches(replica, device):
    """Replica r's MICRO_BATCHES (tokens, next tokens) pairs: other data per replica."""
    generator = torch.Generator().manual_seed(replica)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def max_difference_between_copies(weight):
    """Largest |copy on any rank - copy on rank 0|, over every stage and replica."""
    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, weight.detach().contiguous())
    return max((copy - copies[0]).abs().max().item() for copy in copies)


# --8<-- [start:configs]
BASE = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True}  # a torch.optim.SGD, as elsewhere
CONFIGS = {
    "ZeRO-1": {**BASE, "zero_optimization": {"stage": 1}},
    "bf16": {**BASE, "bf16": {"enabled": True}},
    "bf16 + ZeRO-1": {**BASE, "bf16": {"enabled": True},
                      "zero_optimization": {"stage": 1}},
}
# --8<-- [end:configs]


# --8<-- [start:train]
def train(name):
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), LayerSpec(Mixer),
              LayerSpec(Mixer),
              TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM,
                            forward_fn=logits_from_embedding)]
    model = PipelineModule(layers, num_stages=STAGES, loss_fn=cross_entropy,
                           seed_layers=True, base_seed=SEED, partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with contextlib.redirect_stdout(io.StringIO()):  # BF16_Optimizer prints memory use
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=CONFIGS[name])
    replica = engine.grid.get_data_parallel_id()
    weight = engine.module.tied_modules["embed"].weight  # what forward uses
    losses, differences, masters = [], [], []
    for step in range(STEPS):
        batches = micro_batches(replica, engine.device)
        losses.append(engine.train_batch(data_iter=batches).float().item())
        master = safe_get_full_fp32_param(weight)  # the fp32 copy the optimizer updates
        differences.append((max_difference_between_copies(weight),
                            max_difference_between_copies(master)))
        masters.append(master.detach().clone())
    return engine, weight, losses, differences, masters
# --8<-- [end:train]


def main():
    backend = get_accelerator().communication_backend_name()  # gloo on the CPU
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in CONFIGS:
        engine, weight, losses, differences, masters = train(name)
        results[name] = {"losses": losses, "differences": differences,
                         "dtype": str(weight.dtype), "masters": masters,
                         "optimizer": type(engine.optimizer).__name__,
                         "stage": engine.grid.get_stage_id(),
                         "replica": engine.grid.get_data_parallel_id(),
                         "tie_ranks": engine.module.tied_comms["embed"]["ranks"]}
        if rank == 0:
            print(f"{name} on {world} ranks: {type(engine.optimizer).__name__}, "
                  f"tied weight {weight.dtype}")
            for step, (loss, (diff, master)) in enumerate(zip(losses, differences)):
                print(f"  step {step}: loss {loss:.4f}, max |copy - rank 0 copy| "
                      f"{diff:.4f}, of the fp32 master {master:.4f}")
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
