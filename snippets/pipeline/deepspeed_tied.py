"""A language model whose output head reuses the input embedding, on 2 DeepSpeed pipeline stages.

Run on CPU (2 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/deepspeed_tied.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

VOCAB, DIM, SEQ, SEED, LR = 16, 8, 6, 1234, 0.5
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 4


# --8<-- [start:model]
class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden):
        return torch.tanh(self.linear(hidden))


def logits_from_embedding(embedding, hidden):
    # The head: no weight of its own, it multiplies by the embedding matrix.
    return hidden @ embedding.weight.t()


def layers(tied=True):
    if tied:
        first = TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM)
        last = TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM,
                             forward_fn=logits_from_embedding)
    else:  # the mistake: two independent layers that merely look alike
        first = LayerSpec(nn.Embedding, VOCAB, DIM)
        last = LayerSpec(HeadFromOwnEmbedding)
    return [first, LayerSpec(Mixer), LayerSpec(Mixer), last]


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
# --8<-- [end:model]


# --8<-- [start:helpers]
class HeadFromOwnEmbedding(nn.Embedding):
    """What the untied variant builds on the last stage: its own copy of the embedding."""

    def __init__(self):
        super().__init__(VOCAB, DIM)

    def forward(self, hidden):
        return logits_from_embedding(self, hidden)


def micro_batches():
    """MICRO_BATCHES (tokens, next tokens) pairs: the same on every rank, every step,
    every run."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def embedding_copy(module, tied):
    """This stage's copy of the embedding weight (stage 0: layer 0, stage 1: layer 3)."""
    if tied:
        return module.tied_modules["embed"].weight
    return module.get_submodule("0" if module.stage_id == 0 else "3").weight


def max_difference_between_stages(weight):
    """Largest |stage 0 copy - stage 1 copy|, on every rank: each copy against rank 0's
    (stage 0), as with more ranks than stages rank 1 may hold another stage 0."""
    copies = [torch.empty_like(weight) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(copies, weight.detach().contiguous())
    return max((copy - copies[0]).abs().max().item() for copy in copies)
# --8<-- [end:helpers]


def summary(engine, tied, losses, differences):
    """What the tests check, per rank."""
    weight = embedding_copy(engine.module, tied)
    return {"losses": losses, "differences": differences, "weight": weight.detach().clone(),
            "tie_ranks": engine.module.tied_comms["embed"]["ranks"] if tied else None}


# --8<-- [start:train]
def train(tied):
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": MICRO_BATCHES,  # micro-batches per train_batch()
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; plain PyTorch does not
    }
    # seed_layers: layer i is built right after torch.manual_seed(SEED + i), on whichever stage
    # holds it. The two embedding copies (layers 0 and 3) are therefore built differently.
    model = PipelineModule(layers(tied), num_stages=2, loss_fn=cross_entropy,
                           seed_layers=True, base_seed=SEED, partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    weight = embedding_copy(engine.module, tied)
    differences = [max_difference_between_stages(weight)]
    if not tied:  # give the untied copies the same start, by hand, to be fair to them
        torch.distributed.broadcast(weight.data, src=0)
    losses = []
    for step in range(STEPS):
        losses.append(engine.train_batch(data_iter=micro_batches()).item())
        differences.append(max_difference_between_stages(weight))
    return engine, losses, differences
# --8<-- [end:train]


def main():
    # --8<-- [start:main]
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    results = {}
    for tied in (True, False):
        engine, losses, differences = train(tied)
        results["tied" if tied else "untied"] = summary(engine, tied, losses, differences)
        if rank == 0:
            print("TiedLayerSpec" if tied else "LayerSpec (no tie)")
            print(f"  max |stage 0 copy - stage 1 copy| when built: {differences[0]:.4f}")
            for step, (loss, diff) in enumerate(zip(losses, differences[1:])):
                print(f"  step {step}: loss {loss:.4f}, "
                      f"max |stage 0 copy - stage 1 copy| {diff:.4f}")
    torch.distributed.destroy_process_group()
    # --8<-- [end:main]
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
