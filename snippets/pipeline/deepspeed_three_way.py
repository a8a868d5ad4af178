"""The encoder+decoder tie: one weight for the encoder embedding, the decoder embedding and the
output head, on 3 DeepSpeed pipeline stages (one TiedLayerSpec key used three times).

Run on CPU (3 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 3 snippets/pipeline/deepspeed_three_way.py
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
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 3


# --8<-- [start:model]
class Mixer(nn.Module):
    """A layer that carries the decoder's tokens along:
    (hidden, tokens) -> (hidden', tokens)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, inputs):
        hidden, tokens = inputs
        return torch.tanh(self.linear(hidden)), tokens


def embed_source(embedding, inputs):  # use 1: the encoder's input embedding
    source, target = inputs
    return embedding(source), target


def embed_target(embedding, inputs):  # use 2: the decoder's input embedding, plus the encoding
    encoded, target = inputs
    return embedding(target) + encoded.mean(dim=1, keepdim=True), target


def logits(embedding, inputs):  # use 3: the output head
    hidden, _ = inputs
    return hidden @ embedding.weight.t()


def layers():
    tie = ("embed", nn.Embedding, VOCAB, DIM)
    return [TiedLayerSpec(*tie, forward_fn=embed_source), LayerSpec(Mixer),   # stage 0: encoder
            TiedLayerSpec(*tie, forward_fn=embed_target), LayerSpec(Mixer),   # stage 1: decoder
            TiedLayerSpec(*tie, forward_fn=logits)]                           # stage 2: head


def cross_entropy(output, targets):
    return F.cross_entropy(output.reshape(-1, VOCAB), targets.reshape(-1))
# --8<-- [end:model]


def micro_batches(device):
    """(source, decoder input) and next decoder tokens: a copy task with a shifted target."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(MICRO_BATCHES):
        source = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator).to(device)
        target = torch.roll(source, 1, dims=1)
        yield (source, target[:, :-1]), target[:, 1:]


def main():
    # --8<-- [start:main]
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = dist.get_rank()
    model = PipelineModule(layers(), num_stages=3, loss_fn=cross_entropy,
                           seed_layers=True, base_seed=SEED, partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ds_config = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
                 "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    tie = engine.module.tied_comms["embed"]
    weight = engine.module.tied_modules["embed"].weight
    print(f"[rank {rank}] tied modules on this stage: {list(engine.module.tied_modules)}, "
          f"tie group {tie['ranks']}")

    losses = []
    for step in range(STEPS):
        losses.append(engine.train_batch(data_iter=micro_batches(engine.device)).item())
        copies = [torch.empty_like(weight) for _ in range(3)]
        dist.all_gather(copies, weight.detach().contiguous())
        if rank == 0:
            difference = max((c - copies[0]).abs().max().item() for c in copies)
            print(f"step {step}: loss {losses[-1]:.4f}, max |copy - stage 0 copy| {difference:.4f}")
    # --8<-- [end:main]
    result = {"losses": losses, "weight": weight.detach().clone(), "tie_ranks": tie["ranks"],
              "tied_modules": list(engine.module.tied_modules),
              "parameters": {name: p.detach().clone() for name, p in engine.module.named_parameters()}}
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
