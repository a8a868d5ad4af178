"""GatheredParameters around a weight that a running module holds: "Cannot free a ZeRO-3
parameter while it is still active in submodules" (older releases: an AssertionError from
free_param). Three shapes readers write, and the fix checked against plain PyTorch.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/free_active_param.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from torch import nn

VOCAB, HIDDEN, BATCH, SEQ, STEPS, SEED, LR = 16, 8, 4, 5, 3, 0, 0.1


# --8<-- [start:model]
class TiedLM(nn.Module):
    """Embeddings, one layer, and a head that reuses the embedding weight."""

    def __init__(self, gather_in_forward=False):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.gather_in_forward = gather_in_forward

    def forward(self, tokens):
        hidden = torch.tanh(self.layer(self.embeddings(tokens)))
        weight = self.embeddings.weight
        if self.gather_in_forward:  # the form of DeepSpeed's docstring
            with deepspeed.zero.GatheredParameters(weight, fwd_module=self):
                return hidden @ weight.t()
        return hidden @ weight.t()  # DeepSpeed detects this read and gathers the weight
# --8<-- [end:model]


def batch(step):
    generator = torch.Generator().manual_seed(SEED + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)


def error_of(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what the case shows
        return f"{type(error).__name__}: {error}"
    return None


def engine_for(model_kwargs):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": BATCH // world,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = TiedLM(**model_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, slice(rank, None, world)


def train(engine, mine, record, before_step=lambda engine: []):
    for step in range(STEPS):
        record["released in the block"].append(before_step(engine))
        tokens = batch(step)[mine].to(engine.device)
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        record["grads"].append({name: safe_get_full_grad(p).clone()
                                for name, p in engine.module.named_parameters()})
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        record["losses"].append(mean.item() / torch.distributed.get_world_size())


# --8<-- [start:around_forward]
def gathered_forward(engine):
    """Logits with every weight gathered, as generation helpers do before generate().
    Returns the weights found released inside the block, once the forward returned."""
    model = engine.module
    weights = dict(model.named_parameters())  # no gather: named_parameters
    with deepspeed.zero.GatheredParameters(list(weights.values())), torch.no_grad():
        model(batch(0)[:, :-1].to(engine.device))
        return [name for name, w in weights.items() if w.numel() != w.ds_numel]
# --8<-- [end:around_forward]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    say(f"deepspeed {deepspeed.__version__}")
    results = {}
    for case, kwargs, before_step in (
            ("gathered in forward", {"gather_in_forward": True}, lambda engine: []),
            ("gathered around forward", {}, gathered_forward),
            ("fix: no gather", {}, lambda engine: [])):
        record = {"losses": [], "grads": [], "released in the block": []}
        engine, mine = engine_for(kwargs)
        error = error_of(lambda: train(engine, mine, record, before_step))
        results[case] = {**record, "error": error}
        losses = " ".join(f"{x:.4f}" for x in record["losses"])
        say(f"{case}: losses {losses or '-'}", f"then {error}" if error else "")
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
