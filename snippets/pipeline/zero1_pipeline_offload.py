"""ZeRO with a DeepSpeed pipeline: stage 2 is refused; stage 1, also with its optimizer
offloaded to the CPU, trains the tied pipeline like one process.

Run on CPU (4 processes: 2 stages x 2 data-parallel replicas, so that ZeRO-1 has replicas
to partition the optimizer state over):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 snippets/pipeline/zero1_pipeline_offload.py
Run and tested here on CPU only (on 4 ranks and on 2, one replica); not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from torch import nn

VOCAB, DIM, SEQ, SEED, LR, MOMENTUM = 16, 8, 6, 1234, 0.5, 0.9
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
        "zero_allow_untested_optimizer": True}
OFFLOAD = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
CONFIGS = {
    "ZeRO-2": {**BASE, "zero_optimization": {"stage": 2}},
    "ZeRO-1": {**BASE, "zero_optimization": {"stage": 1}},
    "ZeRO-1, optimizer offloaded": {**BASE, "zero_optimization": OFFLOAD},
    # Offload with an optimizer of your own (here torch's SGD) needs this key:
    "ZeRO-1, optimizer offloaded, torch SGD allowed": {
        **BASE, "zero_optimization": OFFLOAD, "zero_force_ds_cpu_optimizer": False},
}
# --8<-- [end:configs]


# --8<-- [start:train]
def train(config):
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
              LayerSpec(Mixer), LayerSpec(Mixer),
              TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM,
                            forward_fn=logits_from_embedding)]
    model = PipelineModule(layers, num_stages=STAGES, loss_fn=cross_entropy,
                           seed_layers=True, base_seed=SEED, partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    replica = engine.grid.get_data_parallel_id()
    weight = engine.module.tied_modules["embed"].weight
    losses, differences = [], []
    for _ in range(STEPS):
        batch = micro_batches(replica, engine.device)
        losses.append(engine.train_batch(data_iter=batch).item())
        differences.append(max_difference_between_copies(weight))
    return engine, losses, differences
# --8<-- [end:train]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = dist.get_rank()
    results = {}
    # --8<-- [start:main]
    for name, config in CONFIGS.items():
        try:
            engine, losses, differences = train(config)
        except (AssertionError, ZeRORuntimeException) as error:
            results[name] = f"{type(error).__name__}: {error}"
            if rank == 0:
                print(f"{name}: {results[name]}")
            continue
        optimizer = engine.optimizer
        results[name] = {"losses": losses, "differences": differences,
                         "optimizer": type(optimizer).__name__,
                         "cpu_offload": optimizer.cpu_offload,
                         "parameters": {n: p.detach().clone()
                                        for n, p in engine.module.named_parameters()}}
        if rank == 0:
            print(f"{name}: {type(optimizer).__name__}, "
                  f"cpu_offload={optimizer.cpu_offload}")
            for step, (loss, gap) in enumerate(zip(losses, differences)):
                print(f"  step {step}: loss {loss:.4f}, "
                      f"max |copy - rank 0 copy| {gap:.4f}")
    # --8<-- [end:main]
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
