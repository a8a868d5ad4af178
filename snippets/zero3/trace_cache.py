"""A module used on some steps only, under ZeRO-3: DeepSpeed prints "Invalidate trace cache"
when the order of modules changes from one step to the next, and the skipped head is updated
again with its previous gradient (the step-3 loss differs from plain PyTorch's). Called on
every step with a zero contribution, it trains like plain PyTorch. More schedules:
stale_gradient.py. (Time per step: benchmarks/trace_cache.py.)

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/trace_cache.py
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

VOCAB, HIDDEN, BATCH, SEQ, SEED, LR = 16, 8, 4, 5, 0, 0.1
STEPS = int(os.environ.get("TRACE_CACHE_STEPS", "4"))


# --8<-- [start:model]
class AuxiliaryHead(nn.Linear):
    def forward(self, hidden, with_bias=True):
        return F.linear(hidden, self.weight, self.bias if with_bias else None)


class WithAuxiliaryHead(nn.Module):
    """A tied language model with an auxiliary head that only some steps use."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.aux = AuxiliaryHead(HIDDEN, VOCAB)

    def forward(self, tokens, aux="used"):
        hidden = torch.tanh(self.layer(self.embeddings(tokens)))
        logits = hidden @ self.embeddings.weight.t()
        if aux == "used":
            logits = logits + self.aux(hidden)
        elif aux == "zero":  # the same module order as "used", and a zero gradient
            logits = logits + 0.0 * self.aux(hidden)
        elif aux == "no bias":  # the same module order: aux.bias gets no gradient
            logits = logits + self.aux(hidden, with_bias=False)
        return logits  # "skipped": another module order on these steps
# --8<-- [end:model]


def batch(step):
    generator = torch.Generator().manual_seed(SEED + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)


# schedule: (what the auxiliary head does in a step, the optimizer)
SCHEDULES = {
    "every step": (lambda step: "used", "SGD"),
    "odd steps": (lambda step: "used" if step % 2 else "skipped", "SGD"),
    "odd steps, always called": (lambda step: "used" if step % 2 else "zero", "SGD"),
}


def engine_for(optimizer_name):
    world = torch.distributed.get_world_size()
    # --8<-- [start:config]
    config = {"train_micro_batch_size_per_gpu": BATCH // world,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "log_trace_cache_warnings": True},  # off by default
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    # --8<-- [end:config]
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = WithAuxiliaryHead()
    optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def full_grad(param):
    grad = safe_get_full_grad(param)  # None for a module this step did not use
    return torch.zeros(param.ds_shape) if grad is None else grad.clone()


def train_step(engine, aux, step):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tokens = batch(step)[rank::world].to(engine.device)
    logits = engine(tokens[:, :-1], aux=aux)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    grads = {name: full_grad(p) for name, p in engine.module.named_parameters()}
    engine.step()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    return mean.item() / world, grads


def main(schedules=SCHEDULES):
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    say = print if torch.distributed.get_rank() == 0 else (lambda *args, **kwargs: None)
    results = {}
    for schedule, (aux_in, optimizer_name) in schedules.items():
        say(f"auxiliary head on {schedule}:", flush=True)
        engine = engine_for(optimizer_name)
        record = {"losses": [], "grads": []}
        for step in range(STEPS):
            loss, grads = train_step(engine, aux_in(step), step)
            record["losses"].append(loss)
            record["grads"].append(grads)
            aux = grads["aux.bias"].abs().sum().item()
            say(f"  step {step}: loss {loss:.4f}, aux.bias gradient sum |g| {aux:.4f}",
                flush=True)
        results[schedule] = record
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
