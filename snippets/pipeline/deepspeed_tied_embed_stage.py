"""A tied embedding alone on a pipeline stage of its own, with ZeRO-1 in fp32 (the layout
of DeepSpeed issue #1522): the first stage holding only the embedding (a partition given by
hand), then the partition `partition_method="type:embed"` makes.

Run on CPU (2 processes: 2 stages; 4 processes: 2 stages x 2 data-parallel replicas):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/deepspeed_tied_embed_stage.py
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 snippets/pipeline/deepspeed_tied_embed_stage.py
Run and tested here on CPU only; not run on GPUs.
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

VOCAB, DIM, SEQ, SEED, LR, CLIP = 16, 8, 6, 1234, 0.5, 0.3
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


# --8<-- [start:partition]
class PipelineWithStages(PipelineModule):
    """A PipelineModule whose stage boundaries are given by hand: `parts[s]` is the first
    layer of stage s. DeepSpeed's partition_method has no such choice ("uniform",
    "parameters", "type:REGEX"), so this replaces the method that computes them."""

    def __init__(self, layers, parts, **kwargs):
        self.given_parts = parts
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method):
        self.parts = self.given_parts
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


LAYERS = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), LayerSpec(Mixer),
          LayerSpec(Mixer),
          TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM,
                        forward_fn=logits_from_embedding)]


def seed_layer(seed):
    """What seed_layers=True does for torch, with the seed made a Python int: the
    type: and parameters partitions hand it a numpy integer (see main)."""
    torch.manual_seed(int(seed))


PARTITIONS = {
    # stage 0: the embedding alone; stage 1: the mixers and the tied head
    "by hand, [0, 1, 4]": lambda **kw: PipelineWithStages(LAYERS, [0, 1, 4], **kw),
    'partition_method="type:embed"':
        lambda **kw: PipelineModule(LAYERS, partition_method="type:embed",
                                    seed_fn=seed_layer, **kw),
}
CONFIG = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
          "gradient_accumulation_steps": MICRO_BATCHES,
          "gradient_clipping": CLIP,  # below the gradients' norm: clipping acts
          "zero_optimization": {"stage": 1},
          "zero_allow_untested_optimizer": True}  # a torch.optim.SGD
# --8<-- [end:partition]


def describe(spec):
    if isinstance(spec, TiedLayerSpec):
        return "tied head" if spec.forward_fn else "tied embedding"
    return spec.typename.__name__


def max_difference_between_copies(weight):
    """Largest |copy on any rank - copy on rank 0|, over every stage and replica."""
    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, weight.detach().contiguous())
    return max((copy - copies[0]).abs().max().item() for copy in copies)


# --8<-- [start:train]
def train(partition):
    model = PARTITIONS[partition](num_stages=STAGES, loss_fn=cross_entropy,
                                  seed_layers=True, base_seed=SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    replica = engine.grid.get_data_parallel_id()
    weight = engine.module.tied_modules["embed"].weight
    parts = [int(part) for part in engine.module.parts]  # each stage's first layer
    losses, norms, differences = [], [], []
    for step in range(STEPS):
        batches = micro_batches(replica, engine.device)
        losses.append(engine.train_batch(data_iter=batches).item())
        norms.append(engine.get_global_grad_norm())  # what clipping divided by
        differences.append(max_difference_between_copies(weight))
    return {"losses": losses, "norms": norms, "differences": differences,
            "weight": weight.detach().clone(), "parts": parts,
            "stage": engine.grid.get_stage_id(), "replica": replica,
            "optimizer": type(engine.optimizer).__name__}
# --8<-- [end:train]


def main():
    backend = get_accelerator().communication_backend_name()  # gloo on the CPU
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for partition in PARTITIONS:
        results[partition] = got = train(partition)
        if rank == 0:
            print(f"{partition} on {world} ranks, {got['optimizer']}:")
            for stage in range(STAGES):
                held = LAYERS[got["parts"][stage]:got["parts"][stage + 1]]
                print(f"  stage {stage}: {', '.join(map(describe, held))}")
            for step, loss in enumerate(got["losses"]):
                print(f"  step {step}: loss {loss:.4f}, gradient norm "
                      f"{got['norms'][step]:.4f}, max |copy - rank 0 copy| "
                      f"{got['differences'][step]:.4f}")
    dist.destroy_process_group()
    return results


# --8<-- [start:seeded]
def seeded_by_deepspeed():
    """The type:embed partition with DeepSpeed's own layer seeding (no seed_fn)."""
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    # Raises: the seed is base_seed + a numpy integer from the partition, and random.seed
    # takes no numpy integers (Python 3.11 and later).
    PipelineModule(LAYERS, num_stages=STAGES, loss_fn=cross_entropy, seed_layers=True,
                   base_seed=SEED, partition_method="type:embed")
    dist.destroy_process_group()  # never reached: the line above raises
# --8<-- [end:seeded]


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
