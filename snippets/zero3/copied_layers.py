"""torch's nn.TransformerEncoder built inside deepspeed.zero.Init: it makes its layers with
copy.deepcopy of the layer it is given, which zero.Init has already partitioned. Each copy is
a plain Parameter of shape (0,), not a ZeRO-3 parameter, and the first forward fails.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/copied_layers.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, HEADS, LAYERS, BATCH, SEQ, SEED, LR = 16, 8, 2, 2, 4, 5, 0, 0.1


def ds_config(world, **zero):
    return {
        "train_micro_batch_size_per_gpu": BATCH // world,
        # every parameter partitioned (DeepSpeed's default, 1e5, keeps small ones whole)
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }


# --8<-- [start:model]
class Encoder(nn.Module):
    """A small language model on torch's own nn.TransformerEncoder."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0,
                                           batch_first=True)
        # copies `layer` LAYERS times with copy.deepcopy (torch's _get_clones)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


class Decoder(nn.Module):
    """The same on nn.TransformerDecoder, which copies its layer the same way."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerDecoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0,
                                           batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, LAYERS)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        hidden = self.embed(tokens)
        return self.head(self.decoder(hidden, hidden))
# --8<-- [end:model]


def make_batch(step, rank=0, world=1):
    """Step `step`'s batch: this rank's consecutive share of it."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    share = BATCH // world
    return tokens[rank * share:(rank + 1) * share], targets[rank * share:(rank + 1) * share]


def loss_of(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def describe(model):
    """What zero.Init made of some of the model's parameters."""
    for name in ("embed.weight", "encoder.layers.0.linear1.weight", "head.weight"):
        param = model.get_parameter(name)
        kind = f"ds_id {param.ds_id}" if hasattr(param, "ds_id") else "no ds_id"
        full = f", full shape {tuple(param.ds_shape)}" if hasattr(param, "ds_shape") else ""
        print(f"{name}: shape {tuple(param.shape)}, {kind}{full}")


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = ds_config(world)
    torch.manual_seed(SEED)
    # --8<-- [start:train]
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Encoder()
    if rank == 0:
        describe(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    tokens, targets = make_batch(0, rank, world)
    loss = loss_of(engine, tokens, targets)  # raises: the copies hold nothing
    engine.backward(loss)  # never reached: the line above raises
    engine.step()  # never reached
    # --8<-- [end:train]


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # never reached: main() raises (the ending of every example)
    os._exit(0)  # never reached
