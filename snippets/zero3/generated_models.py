"""Seeded small models that share one weight in every way the outcome depends on, each
trained under ZeRO-3 and in plain PyTorch (losses and full gradients, or the error), and
checked by check_shared_reads.py: the checker's verdict should match the runs.

Run on CPU (2 processes): the ZeRO-3 runs of the first models
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/generated_models.py
Run and tested here on CPU only; not run on GPUs.
"""
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.utils.checkpoint import checkpoint

DIM, BATCH, STEPS, SEED, LR = 6, 4, 3, 0, 0.1
SAMPLE = 24  # models the suite runs; the benchmark runs many more

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 0.0,
}

# --8<-- [start:dimensions]
# How the reading forward (Block.forward) gets the shared weight, owner.weight.
ACCESS = {
    "attribute": lambda b, owner: b.owner.weight,
    "getattr": lambda b, owner: getattr(b.owner, "weight"),
    "_parameters": lambda b, owner: b.owner._parameters["weight"],
    "named_parameters": lambda b, owner: dict(b.owner.named_parameters())["weight"],
    "parameters": lambda b, owner: next(b.owner.parameters()),
    "state_dict": lambda b, owner: b.owner.state_dict(keep_vars=True)["weight"],
    "list of Parameter": lambda b, owner: b.tied[0],
    "dict of Parameter": lambda b, owner: b.tables["weight"],
    "object with Parameter": lambda b, owner: b.config.weight,
    "list of module": lambda b, owner: b.owners[0].weight,
    "dict of module": lambda b, owner: b.modules_by_name["owner"].weight,
    "object with module": lambda b, owner: b.config.owner.weight,
    "module argument": lambda b, owner: owner.weight,
}
# What is computed with it; what the backward needs of it differs.
USE = {
    "matmul": lambda h, w: h @ w.t(),  # backward needs w's values (through a view)
    "linear": lambda h, w: F.linear(h, w),  # backward needs w itself
    "embedding": lambda h, w: h + F.embedding(torch.arange(h.shape[0]) % DIM, w),
    "sum": lambda h, w: h + w.sum(0),  # an empty weight passes forward, fails backward
}
REGISTER = ("nowhere", "reader", "receiver", "owner", "ancestor")
ENTRY = ("engine", "engine.module", "loop calls the block", "forward hook", "checkpoint")
COMPUTE = ("reader computes", "reader passes it on")
# --8<-- [end:dimensions]


def draw(index, seed=SEED):
    """The spec of generated model `index`: one value of every dimension."""
    pick = random.Random(f"{seed}:{index}")
    calls = pick.choice((0, 1, 2))  # owner's forward calls inside the reading forward
    read = pick.randint(0, calls)  # slot: before call 0, between calls, after the last
    return {
        "access": pick.choice(list(ACCESS)), "use": pick.choice(list(USE)),
        "owner calls": calls, "read slot": read, "use slot": pick.randint(read, calls),
        "owner before block": pick.choice((False, True)),
        "register": pick.choice(REGISTER), "entry": pick.choice(ENTRY),
        "compute": pick.choice(COMPUTE),
    }


# --8<-- [start:model]
class Receiver(nn.Module):
    """Gets the weight as a tensor argument and computes with it."""

    def __init__(self, use):
        super().__init__()
        self.proj, self.use = nn.Linear(DIM, DIM), use

    def forward(self, h, weight):
        return USE[self.use](self.proj(h), weight)


class Block(nn.Module):
    """The reader: its forward reads owner.weight and computes with it or passes it on."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.owner = nn.Linear(DIM, DIM)
        self.receiver = Receiver(spec["use"])
        # References outside the module tree: lists, dicts and plain objects.
        self.owners, self.modules_by_name = [self.owner], {"owner": self.owner}
        self.tied, self.tables = [self.owner.weight], {"weight": self.owner.weight}
        self.config = SimpleNamespace(owner=self.owner, weight=self.owner.weight)

    def forward(self, h, owner=None):
        spec, weight = self.spec, None
        for slot in range(spec["owner calls"] + 1):
            if slot == spec["read slot"]:
                weight = ACCESS[spec["access"]](self, owner)
            if slot == spec["use slot"]:
                if spec["compute"] == "reader computes":
                    h = USE[spec["use"]](h, weight)
                else:
                    h = self.receiver(h, weight)
            if slot < spec["owner calls"]:
                h = torch.tanh(self.owner(h))  # the owner's own forward
        return h


class Model(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.pre, self.block, self.post = nn.Linear(DIM, DIM), Block(spec), nn.Linear(DIM, DIM)
        module = {"reader": self.block, "receiver": self.block.receiver,
                  "owner": self.block.owner, "ancestor": self}.get(spec["register"])
        if module is not None:
            deepspeed.zero.register_external_parameter(module, self.block.owner.weight)
        if spec["entry"] == "forward hook":
            self.pre.register_forward_hook(lambda m, args, out: self.run_block(out))

    def run_block(self, h):
        if self.spec["owner before block"]:
            h = self.block.owner(h)
        return self.block(h, self.block.owner)

    def forward(self, x):
        h = self.pre(x)
        entry = self.spec["entry"]
        if entry in ("engine", "engine.module"):
            h = self.run_block(h)
        elif entry == "checkpoint":
            h = checkpoint(self.run_block, h, use_reentrant=False)
        elif entry == "loop calls the block":
            return h  # the training loop calls the block
        return self.post(h)


def loss_of(engine, inputs, spec):
    """One step's loss, entering the reading forward the way the spec says."""
    x, target = inputs
    if spec["entry"] == "engine.module":
        out = engine.module(x)
    elif spec["entry"] == "loop calls the block":
        out = engine.module.post(engine.module.run_block(engine(x)))
    else:
        out = engine(x)
    return F.mse_loss(out, target)
# --8<-- [end:model]


def make_batch(step):
    generator = torch.Generator().manual_seed(SEED + step)
    return torch.randn(BATCH, DIM, generator=generator), torch.randn(BATCH, DIM, generator=generator)


class PlainEngine:
    def __init__(self, module):
        self.module = module

    def __call__(self, *args):
        return self.module(*args)


def train_plain(spec):
    torch.manual_seed(SEED)
    model = Model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        loss = loss_of(PlainEngine(model), make_batch(step), spec)
        loss.backward()
        # A parameter the step did not use has no gradient: zero, as under ZeRO-3.
        grads.append({n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def full_grad(param):
    grad = deepspeed.utils.safe_get_full_grad(param)
    return torch.zeros(param.ds_shape) if grad is None else grad.clone()


def train_zero3(spec, findings=()):
    """Losses and full gradients under ZeRO-3, or where and what it raised. findings:
    the checker's, whose fixes are applied to the built model as the checker states them."""
    torch.manual_seed(SEED)
    losses, grads, where = [], [], "while building the model"
    try:
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
            model = Model(spec)
        if findings:
            where = "while applying the fixes"
            checker().apply_fixes(model, findings)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
        for step in range(STEPS):
            where = f"in step {step}"
            loss = loss_of(engine, make_batch(step), spec)
            where = f"in backward of step {step}"
            engine.backward(loss)
            grads.append({n: full_grad(p) for n, p in engine.module.named_parameters()})
            engine.step()
            losses.append(loss.item())
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"where": where, "error": f"{type(error).__name__}: {error}"}
    return {"losses": losses, "grads": grads}


def checker():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import check_shared_reads

    return check_shared_reads


def fixes():
    """GENERATED_FIXES: {index: the checker's findings} as JSON, for a run of those models
    with the fixes applied; none by default."""
    return {int(i): f for i, f in json.loads(os.environ.get("GENERATED_FIXES", "{}")).items()}


def indices():
    """Which models this run trains: those of GENERATED_FIXES, or GENERATED_MODELS=
    first:count or a list like 40,66; by default the sample."""
    if fixes():
        return sorted(fixes())
    chosen = os.environ.get("GENERATED_MODELS", f"0:{SAMPLE}")
    if ":" not in chosen:
        return [int(index) for index in chosen.split(",")]
    first, _, count = chosen.partition(":")
    return range(int(first), int(first) + int(count))


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    results = {}
    fixed = fixes()
    for index in indices():
        spec = draw(index)
        results[index] = {"spec": spec, "zero3": train_zero3(spec, fixed.get(index, ())),
                          "plain": train_plain(spec)}
    if torch.distributed.get_rank() == 0:
        errors = [r["zero3"] for r in results.values() if "error" in r["zero3"]]
        how = " with the checker's fixes" if fixed else ""
        print(f"{len(results)} generated models trained under ZeRO-3{how}; "
              f"{len(errors)} raised an error:")
        for where, error in sorted({(e["where"], e["error"]) for e in errors}):
            print(f"- {where}: `{error}`")
    torch.distributed.destroy_process_group()
    return results


def checker_verdicts():
    """check_shared_reads.py on the same models: {index: (spec, findings as dicts)}."""
    check_shared_reads = checker().check_shared_reads
    verdicts = {}
    for index in indices():
        spec = draw(index)
        torch.manual_seed(SEED)
        findings = check_shared_reads(
            lambda: Model(spec), make_batch(0),
            loop=lambda engine, inputs: loss_of(engine, inputs, spec), steps=STEPS)
        verdicts[index] = (spec, [vars(finding) for finding in findings])
    return verdicts


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
