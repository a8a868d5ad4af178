"""When a ZeRO-3 weight is whole, by training step and by ZeRO-3 setting, and what that
means for a read of the weight that DeepSpeed does not detect. The other examples set
stage3_param_persistence_threshold to 0; this one also runs DeepSpeed's defaults, with
an embedding below, at and above the default threshold.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/settings_and_steps.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from torch import nn

DIM, SEQ, BATCH, STEPS, SEED, LR = 8, 6, 8, 3, 0, 0.1

# --8<-- [start:settings]
THRESHOLD_0 = {"stage3_param_persistence_threshold": 0}  # the other examples' setting
LEAN = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
SETTINGS = {  # name: (vocabulary, ZeRO-3 settings besides stage 3)
    "threshold 0": (16, THRESHOLD_0),
    "threshold 0, reuse 0, prefetch 0": (16, {**THRESHOLD_0, **LEAN}),
    "defaults, embedding 16 x 8": (16, {}),
    "defaults, embedding 12500 x 8": (12500, {}),  # 100000 elements
    "defaults, embedding 12501 x 8": (12501, {}),  # 100008 elements
}
# --8<-- [end:settings]


# --8<-- [start:models]
class LanguageModel(nn.Module):
    """The model of "Registering external parameters", with a vocabulary of choice."""

    def __init__(self, vocab):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        deepspeed.zero.register_external_parameter(self, self.embeddings.weight)

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer(self.embeddings(tokens)))
        return hidden @ self.embeddings.weight.t()


class ListRead(nn.Module):
    """Reads the embedding weight through a list, which DeepSpeed does not see, and
    registers nothing. The logits add that product from step `first` on."""

    def __init__(self, vocab, first):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, vocab)
        self.tied = [self.embeddings.weight]
        self.first, self.step = first, 0

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer(self.embeddings(tokens)))
        logits = self.head(hidden)
        if self.step >= self.first:
            logits = logits + hidden @ self.tied[0].t()
        return logits
# --8<-- [end:models]


def make_batch(step, vocab):
    """The same batch on every rank, for every run."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def engine_for(model_class, args, settings):
    world = torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": BATCH // world,
              "zero_optimization": {"stage": 3, **settings},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = model_class(*args)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_step(engine, step, vocab, look=lambda moment: None):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    inputs, targets = (t[rank::world].to(engine.device) for t in make_batch(step, vocab))
    logits = engine(inputs)
    look("engine(...) returned")
    loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    engine.backward(loss)
    look("engine.backward returned")
    grads = {name: deepspeed.utils.safe_get_full_grad(p).clone()
             for name, p in engine.module.named_parameters()}
    engine.step()
    look("engine.step returned")
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    return mean.item() / world, grads


# --8<-- [start:watch]
def shape(param):
    return "whole" if param.numel() == param.ds_numel else str(tuple(param.shape))


def watch(vocab, settings):
    """The shape of two weights at moments of each step, on this rank."""
    engine = engine_for(LanguageModel, (vocab,), settings)
    # Read through references taken here: reading model.mixer.weight in a hook
    # during forward would make DeepSpeed gather it.
    weights = dict(engine.module.named_parameters())
    seen = {}

    def look(moment):
        for name in ("embeddings.weight", "mixer.weight"):
            seen.setdefault((name, moment), []).append(shape(weights[name]))

    look("after deepspeed.initialize")
    engine.module.mixer.register_forward_hook(
        lambda module, args, output: look("mixer.forward ended"))
    for step in range(STEPS):
        train_step(engine, step, vocab, look)
    return seen
# --8<-- [end:watch]


def read_from(vocab, settings, first):
    """ListRead trained for STEPS steps: losses and full gradients, or where it failed."""
    engine = engine_for(ListRead, (vocab, first), settings)
    losses, grads = [], []
    try:
        for step in range(STEPS):
            engine.module.step = step
            loss, step_grads = train_step(engine, step, vocab)
            losses.append(loss)
            grads.append(step_grads)
    except RuntimeError as error:
        error = f"step {step}: RuntimeError: {error}"
        return {"losses": losses, "grads": grads, "error": error}
    return {"losses": losses, "grads": grads, "error": None}


def report(name, vocab, seen, reads):
    print(f"{name}: embeddings.weight {vocab} x {DIM} ({vocab * DIM} elements), "
          f"in steps {list(range(STEPS))}")
    for (weight, moment), shapes in seen.items():
        if weight == "embeddings.weight":
            mixer = seen["mixer.weight", moment]
            print(f"  {moment:27} embeddings.weight {' '.join(shapes):18} "
                  f"mixer.weight {' '.join(mixer)}")
    for first, result in reads.items():
        outcome = result["error"] or "trains, losses " + " ".join(
            f"{loss:.4f}" for loss in result["losses"])
        print(f"  list read from step {first}: {outcome}")


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    defaults = DeepSpeedZeroConfig()
    if rank == 0:
        print("DeepSpeed's defaults: stage3_param_persistence_threshold "
              f"{defaults.param_persistence_threshold}, stage3_max_reuse_distance "
              f"{defaults.max_reuse_distance}, stage3_prefetch_bucket_size "
              f"{defaults.prefetch_bucket_size}")
        print("whole: the full shape on this rank; (0,): released")
    results = {}
    for name, (vocab, settings) in SETTINGS.items():
        seen = watch(vocab, settings)
        reads = {first: read_from(vocab, settings, first) for first in (0, 1)}
        results[name] = {"seen": seen, "reads": reads}
        if rank == 0:
            report(name, vocab, seen, reads)
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
