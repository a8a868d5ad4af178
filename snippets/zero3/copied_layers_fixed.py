"""The models of copied_layers.py trained under ZeRO-3 like one process: built with the
checker's two fixes, or built without deepspeed.zero.Init. Each trains 3 steps on this
rank's share of every batch; rank 0 also trains the model as written in one process, on
the whole batch, and prints the losses. And the model as written under DeepSpeed's default
stage3_param_persistence_threshold (1e5): it fails as under 0.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/copied_layers_fixed.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from torch import nn

from copied_layers import BATCH, DIM, HEADS, LAYERS, LR, SEED, VOCAB
from copied_layers import Decoder, Encoder, ds_config, loss_of, make_batch

STEPS = 3


# --8<-- [start:fixed]
class FixedEncoder(Encoder):
    """Encoder's __init__ with the checker's two fixes, as it states them."""

    def __init__(self):
        nn.Module.__init__(self)
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0,
                                           batch_first=True)
        # What MultiheadAttention.__init__ did to its out_proj, lost under zero.Init
        with deepspeed.zero.GatheredParameters(layer.self_attn.out_proj.bias, modifier_rank=0):
            nn.init.constant_(layer.self_attn.out_proj.bias, 0.0)
        # Copied from the whole layer, the copies get its weights
        with deepspeed.zero.GatheredParameters(layer.parameters()):
            self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)
# --8<-- [end:fixed]


class FixedDecoder(Decoder):
    """Decoder's __init__ with the checker's fixes: its layer has two attentions."""

    def __init__(self):
        nn.Module.__init__(self)
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerDecoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0,
                                           batch_first=True)
        with deepspeed.zero.GatheredParameters(layer.self_attn.out_proj.bias, modifier_rank=0):
            nn.init.constant_(layer.self_attn.out_proj.bias, 0.0)
        bias = layer.multihead_attn.out_proj.bias
        with deepspeed.zero.GatheredParameters(bias, modifier_rank=0):
            nn.init.constant_(bias, 0.0)
        with deepspeed.zero.GatheredParameters(layer.parameters()):
            self.decoder = nn.TransformerDecoder(layer, LAYERS)
        self.head = nn.Linear(DIM, VOCAB)


MODELS = {"encoder": (Encoder, FixedEncoder), "decoder": (Decoder, FixedDecoder)}
CASES = ("the checker's fixes", "built without zero.Init", "default persistence threshold")


def build(kind, case, config):
    """The model as the case builds it, under the case's ZeRO-3 config."""
    written, fixed = MODELS[kind]
    torch.manual_seed(SEED)
    if case == "built without zero.Init":
        return written()  # deepspeed.initialize partitions it
    with deepspeed.zero.Init(config_dict_or_path=config):
        return fixed() if case == "the checker's fixes" else written()


def full_grad(param):
    grad = safe_get_full_grad(param)
    return torch.zeros(param.ds_shape) if grad is None else grad.clone()


def train_zero3(kind, case, rank, world):
    """STEPS steps on this rank's share of each batch: the mean loss over the ranks and
    the full gradients of each step, or the error."""
    zero = {"stage3_param_persistence_threshold": 100000} if case.startswith("default") else {}
    config = ds_config(world, **zero)
    model = build(kind, case, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses, grads = [], []
    try:
        for step in range(STEPS):
            loss = loss_of(engine, *make_batch(step, rank, world))
            engine.backward(loss)
            grads.append({n: full_grad(p) for n, p in engine.module.named_parameters()})
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
    except AssertionError as error:  # the copies as written: the result
        return {"error": f"{type(error).__name__}: {error}", "step": len(losses)}
    return {"losses": losses, "grads": grads}


def train_plain(kind):
    """The model as written, in one process without DeepSpeed, on the whole batch."""
    torch.manual_seed(SEED)
    model = MODELS[kind][0]()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        loss = loss_of(model, *make_batch(step))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    runs = {}
    for kind in MODELS:
        runs[kind] = {case: train_zero3(kind, case, rank, world) for case in CASES}
        runs[kind]["one process"] = train_plain(kind)
        if rank == 0:
            for case in (*CASES, "one process"):
                run = runs[kind][case]
                if "error" in run:
                    print(f"{kind}, {case}: fails in step {run['step']}: {run['error']}")
                    continue
                losses = " ".join(f"{x:.4f}" for x in run["losses"])
                print(f"{kind}, {case}: losses {losses}")
    torch.distributed.destroy_process_group()
    return runs


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
