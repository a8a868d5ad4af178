"""A weight read under ZeRO-3 on some steps only: the forward reads the auxiliary head's
weight (the head itself is never called) on odd steps. ZeRO-3 records in the first step which
parameters each module uses and prefetches by that record; the weight read in step 1 is added
to the model's parameters then, and the step stops with "RuntimeError: tracing error at step
3: ... expected the next 1 parameters in the parameter fetch queue to be (...) but got ()".
prefetch_trace_fixes.py reads it on every step instead. The tests also run the variants that
READ_ON, ZERO_SETTINGS and VOCAB below choose.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/prefetch_trace.py
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

# The tests also run a vocabulary of 12800: an auxiliary head above 1e5 elements.
VOCAB = int(os.environ.get("VOCAB", "16"))
HIDDEN, BATCH, SEQ, SEED, LR, STEPS, NEW_TOKENS = 8, 4, 5, 0, 0.1, 4, 3


# --8<-- [start:model]
class ReadsHeadWeight(nn.Module):
    """A tied language model whose forward reads an auxiliary head's weight."""

    def __init__(self, register=False):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.aux = nn.Linear(HIDDEN, VOCAB, bias=False)  # never called
        if register:  # fixes the error, not what a step without the read trains
            deepspeed.zero.register_external_parameter(self, self.aux.weight)

    def forward(self, tokens, aux="skipped"):
        hidden = torch.tanh(self.layer(self.embeddings(tokens)))
        logits = hidden @ self.embeddings.weight.t()
        if aux == "read":  # another module's weight, read in this forward
            logits = logits + hidden @ self.aux.weight.t()
        elif aux == "zero":  # read as well, with no effect on the output
            logits = logits + 0.0 * (hidden @ self.aux.weight.t())
        return logits
# --8<-- [end:model]


# --8<-- [start:schedules]
# schedule: (what the forward does with aux.weight in training step N, in the
# generation after step N (None: no generation), register it in __init__)
READS = {
    "odd steps": (lambda step: "read" if step % 2 else "skipped", None, False),
    "step 2 only": (lambda step: "read" if step == 2 else "skipped", None, False),
    "generation only": (lambda step: "skipped", "read", False),
}
# --8<-- [end:schedules]
READ_ON = os.environ.get("READ_ON", "odd steps")

# The page runs the first; the tests also run the others.
ZERO_SETTINGS = {
    "threshold 0": {"stage3_param_persistence_threshold": 0},
    "threshold 0, no prefetch": {"stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 0},
    "defaults": {},
}
SETTINGS = os.environ.get("ZERO_SETTINGS", "threshold 0")


def engine_for(register):
    world = torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": BATCH // world,
              "zero_optimization": {"stage": 3, **ZERO_SETTINGS[SETTINGS]},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = ReadsHeadWeight(register)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def batch(step):
    generator = torch.Generator().manual_seed(SEED + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)


def train_step(engine, aux, step):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tokens = batch(step)[rank::world].to(engine.device)
    logits = engine(tokens[:, :-1], aux=aux)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    grad = safe_get_full_grad(engine.module.aux.weight)  # None: no gradient at all
    grad = torch.zeros(engine.module.aux.weight.ds_shape) if grad is None else grad.clone()
    engine.step()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    return mean.item() / world, grad


# --8<-- [start:generate]
def generate(engine, aux, step):
    """Greedy decoding between training steps: NEW_TOKENS forwards, each one token longer."""
    engine.eval()
    tokens = batch(step)[:, :2].to(engine.device)  # every rank decodes the same prompts
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = engine(tokens, aux=aux)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    engine.train()
    return tokens
# --8<-- [end:generate]


def main(schedules=None):
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    schedules = schedules or {READ_ON: READS[READ_ON]}
    say = print if torch.distributed.get_rank() == 0 else (lambda *args, **kwargs: None)
    results = {}
    for schedule, (train_aux, generate_aux, register) in schedules.items():
        say(f"aux.weight read on {schedule}:", flush=True)
        engine = engine_for(register)
        record = results[schedule] = {"losses": [], "grads": [], "generated": []}
        for step in range(STEPS):
            loss, grad = train_step(engine, train_aux(step), step)
            record["losses"].append(loss)
            record["grads"].append(grad)
            say(f"  step {step}: loss {loss:.4f}, "
                f"aux.weight gradient sum |g| {grad.abs().sum().item():.4f}", flush=True)
            if generate_aux is not None:
                tokens = generate(engine, generate_aux, step)
                record["generated"].append(tokens)
                say(f"  generated after step {step}: {tokens[0].tolist()}", flush=True)
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
