"""Seeded small models whose constructor copies a partitioned module or weight, or whose
forward (or training loop) writes into a weight ZeRO-3 has gathered, each trained under
ZeRO-3 and in plain PyTorch (losses and full gradients, or the error), and checked by
check_shared_reads.py: the checker's verdict should match the runs.

Run on CPU (2 processes): the ZeRO-3 runs of the suite's sample
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/generated_copies.py
Run and tested here on CPU only; not run on GPUs.
"""
import contextlib
import copy
import json
import os
import random
import re
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

DIM, VOCAB, BATCH, SEQ, STEPS, SEED, LR = 6, 10, 4, 3, 3, 0, 0.1
LIMIT = 0.2  # max_norm, and the bound of clamp_
# The models the suite runs (the benchmark runs many more): every construct, and a write in
# a forward, in the loop on the model's copy, and on both copies.
SAMPLE = "1,2,3,4,5,6,7,8,9,16,19,21,23"

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 0.0,
}

# --8<-- [start:dimensions]
# How the constructor makes its layers, or a weight from another (the first two are sound).
CONSTRUCT = ("constructors", "copy.deepcopy inside GatheredParameters",
             "copy.deepcopy of a layer", "nn.TransformerEncoder", "nn.TransformerDecoder",
             "nn.MultiheadAttention", "clone() of a weight", "copy.deepcopy of a weight",
             "weight.data = a tensor", "load_state_dict from a partitioned layer",
             "load_state_dict of whole tensors")
# What changes a weight in place on every step (the embedding's for max_norm, else the
# head's), and where: a forward, or the training loop (on ZeRO-3's copy of the model, or
# on it and on the optimizer's copy).
WRITE = ("none", "max_norm", "clamp_", "mul_", ".data =")
WRITER = ("own forward", "parent forward", "loop, the model's copy",
          "loop, both copies")
# --8<-- [end:dimensions]


def draw(index, seed=SEED):
    """The spec of generated model `index`."""
    pick = random.Random(f"copies:{seed}:{index}")
    sound = pick.random() < 0.4
    construct = pick.choice(CONSTRUCT[:2] if sound else CONSTRUCT[2:])
    write = "none" if pick.random() < 0.5 else pick.choice(WRITE[1:])
    return {"construct": construct, "layers": pick.choice((1, 2)), "write": write,
            "writer": "-" if write == "none" else pick.choice(WRITER)}


# --8<-- [start:writes]
def renorm(weight, tokens):  # what nn.Embedding(max_norm=LIMIT) does in its forward
    torch.embedding_renorm_(weight, tokens, LIMIT, 2.0)


def set_data(weight, tokens):
    weight.data = weight.data * 0.9


WRITES = {  # each under torch.no_grad()
    "max_norm": renorm,
    "clamp_": lambda weight, tokens: weight.clamp_(-LIMIT, LIMIT),
    "mul_": lambda weight, tokens: weight.mul_(0.9),
    ".data =": set_data,
}


class WritingHead(nn.Linear):
    """A head whose forward changes its own weight first."""

    def __init__(self, write):
        super().__init__(DIM, VOCAB)
        self.write = write

    def forward(self, h):
        with torch.no_grad():
            WRITES[self.write](self.weight, None)
        return super().forward(h)
# --8<-- [end:writes]


def fixes_for(fixes, file, line):
    """The checker's fixes for the constructor line `file:line`: (the `with` lines around
    it, the fixes to run before it)."""
    around, before = [], []
    for f in fixes:
        if f["kind"] == "write":
            continue
        if re.match(rf"around `{file}:{line}`", f["where"]):
            around.append(f["fix"])
        elif f"before the copy at `{file}:{line}`" in f["where"]:
            before.append(f)
    return list(dict.fromkeys(around)), before


def redo(fix, scope):
    """A fix that does again, gathered, what a library's __init__ did to a weight: its
    `with` line, around the library's line (from the finding), its `self` as it says."""
    found = re.search(r"\((\w+\.py):(\d+): `(.+?)`, its `self` being `(.+?)`\)", fix["where"])
    module = next(m for m in list(sys.modules.values())
                  if getattr(m, "__file__", "") and m.__file__.endswith("/" + found[1])
                  and "torch" in m.__file__)
    holder = eval(found[4], {}, scope)
    with eval(fix["fix"].removeprefix("with ").removesuffix(":"), {"deepspeed": deepspeed},
              scope):
        exec(found[3], vars(module), {"self": holder})


@contextlib.contextmanager
def checker_fixes(fixes, scope):
    """Around the next line of the caller (a constructor line): the checker's fixes for it,
    applied as they say (the `with` lines around it, what goes before it, before)."""
    caller = sys._getframe(2)
    around, before = fixes_for(fixes, Path(caller.f_code.co_filename).name, caller.f_lineno + 1)
    for fix in before:
        redo(fix, scope)
    with contextlib.ExitStack() as stack:
        for fix in around:
            names = {"deepspeed": deepspeed, **scope}
            stack.enter_context(eval(fix.removeprefix("with ").removesuffix(":"), names))
        yield


def fixes_at_the_end(fixes, scope, cls):
    """The fixes that go at the end of `cls.__init__`."""
    for f in fixes:
        if f["kind"] != "write" and f["where"].startswith(f"at the end of `{cls}.__init__`"):
            redo(f, scope)


# --8<-- [start:model]
class Model(nn.Module):
    def __init__(self, spec, fixes=()):
        super().__init__()
        self.spec, kind, n = spec, spec["construct"], spec["layers"]
        own = spec["writer"] == "own forward"
        max_norm = LIMIT if own and spec["write"] == "max_norm" else None
        self.embed = nn.Embedding(VOCAB, DIM, max_norm=max_norm)
        if kind.startswith("nn.Transformer"):
            make = (nn.TransformerEncoderLayer if kind.endswith("Encoder")
                    else nn.TransformerDecoderLayer)
            layer = make(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True)
            stack = nn.TransformerEncoder if kind.endswith("Encoder") else nn.TransformerDecoder
            with checker_fixes(fixes, locals()):
                self.body = stack(layer, n, **({"enable_nested_tensor": False}
                                               if kind.endswith("Encoder") else {}))
        elif kind == "nn.MultiheadAttention":
            self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        elif kind.startswith("copy.deepcopy") and "weight" not in kind:
            layer = nn.Linear(DIM, DIM)
            gathered = deepspeed.zero.GatheredParameters(
                layer.parameters(), enabled="GatheredParameters" in kind)
            with gathered, checker_fixes(fixes, locals()):
                self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(n)])
        else:
            n = 2 if kind == "load_state_dict from a partitioned layer" else n
            self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(n)])
        if kind == "clone() of a weight":
            with checker_fixes(fixes, locals()):
                self.extra = nn.Parameter(self.layers[0].weight.clone())
        elif kind == "copy.deepcopy of a weight":
            with checker_fixes(fixes, locals()):
                self.extra = copy.deepcopy(self.layers[0].weight)
        elif kind == "weight.data = a tensor":
            with checker_fixes(fixes, locals()):
                self.layers[0].weight.data = torch.eye(DIM) * 0.5
        elif kind == "load_state_dict from a partitioned layer":
            with checker_fixes(fixes, locals()):
                self.layers[1].load_state_dict(self.layers[0].state_dict())
        elif kind == "load_state_dict of whole tensors":
            whole = {"weight": torch.eye(DIM) * 0.5, "bias": torch.zeros(DIM)}
            with checker_fixes(fixes, locals()):
                self.layers[0].load_state_dict(whole)
        writes_head = own and spec["write"] not in ("none", "max_norm")
        self.head = WritingHead(spec["write"]) if writes_head else nn.Linear(DIM, VOCAB)
        fixes_at_the_end(fixes, locals(), "Model")

    def written(self):
        """The weight the spec's write changes."""
        return self.embed.weight if self.spec["write"] == "max_norm" else self.head.weight

    def forward(self, tokens):
        if self.spec["writer"] == "parent forward":
            with torch.no_grad():
                WRITES[self.spec["write"]](self.written(), tokens)
        h = self.embed(tokens)
        kind = self.spec["construct"]
        if kind.startswith("nn.Transformer"):
            h = self.body(h) if kind.endswith("Encoder") else self.body(h, h)
        elif kind == "nn.MultiheadAttention":
            h = h + self.attn(h, h, h, need_weights=False)[0]
        else:
            for layer in self.layers:
                h = torch.tanh(layer(h))
            if "of a weight" in kind:
                h = h @ self.extra
        return self.head(h)


def loss_of(engine, batch, spec, block=None):
    """One step's loss; first the spec's write in the loop, where it says so: on ZeRO-3's
    copy of the model (in GatheredParameters with modifier_rank=0, or the `with` line of
    the checker's fix), and, for "both copies", on the optimizer's copy too
    (safe_set_full_fp32_param)."""
    tokens, targets = batch
    if spec["writer"].startswith("loop"):
        weight = engine.module.written()
        if isinstance(engine, PlainEngine):
            with torch.no_grad():
                WRITES[spec["write"]](weight, tokens)
        else:
            names = {"deepspeed": deepspeed, "engine": engine}
            gathered = (eval(block.removeprefix("with ").removesuffix(":"), names) if block
                        else deepspeed.zero.GatheredParameters(weight, modifier_rank=0))
            with gathered:
                with torch.no_grad():
                    WRITES[spec["write"]](weight, tokens)
                new = weight.detach().clone()
            if spec["writer"] == "loop, both copies":
                deepspeed.utils.safe_set_full_fp32_param(weight, new)
    logits = engine(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
# --8<-- [end:model]


def make_batch(step):
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


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
        grads.append({n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def full_grad(param):
    grad = deepspeed.utils.safe_get_full_grad(param)
    return torch.zeros(param.ds_shape) if grad is None else grad.clone()


def fixed_spec(spec, findings):
    """The spec as the checker's fixes for writes make it: each write moved to the loop, on
    both of ZeRO-3's copies, as the fix says; and the fix's `with` line, if it has one."""
    writes = [f["fix"] for f in findings if f["kind"] == "write"]
    if writes:
        spec = {**spec, "writer": "loop, both copies"}
    return spec, next((w for w in writes if w.startswith("with ")), None)


def train_zero3(spec, findings=()):
    """Losses and full gradients under ZeRO-3, or where and what it raised. findings: the
    checker's, whose fixes are applied as the checker states them."""
    torch.manual_seed(SEED)
    spec, block = fixed_spec(spec, findings)
    losses, grads, where = [], [], "while building the model"
    try:
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
            model = Model(spec, findings)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
        for step in range(STEPS):
            where = f"in step {step}"
            loss = loss_of(engine, make_batch(step), spec, block)
            where = f"in backward of step {step}"
            engine.backward(loss)
            grads.append({n: full_grad(p) for n, p in engine.module.named_parameters()})
            engine.step()
            losses.append(loss.item())
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"where": where, "error": f"{type(error).__name__}: {error}"}
    return {"losses": losses, "grads": grads}


def affected(spec):
    """The parameters the spec's construct or write leaves wrong under ZeRO-3 (what the
    checker should name when the run does not train like one process)."""
    torch.manual_seed(SEED)
    model, kind = Model(spec), spec["construct"]
    names = set()
    if kind.startswith("nn.Transformer") or (
            kind == "copy.deepcopy of a layer"):
        prefix = "body." if kind.startswith("nn.") else "layers."
        names |= {n for n, _ in model.named_parameters() if n.startswith(prefix)}
    names |= {"nn.MultiheadAttention": {"attn.out_proj.bias"},
              "clone() of a weight": {"extra"}, "copy.deepcopy of a weight": {"extra"},
              "weight.data = a tensor": {"layers.0.weight"},
              "load_state_dict from a partitioned layer": {"layers.1.weight", "layers.1.bias"},
              "load_state_dict of whole tensors": {"layers.0.weight", "layers.0.bias"},
              }.get(kind, set())
    if spec["write"] != "none" and spec["writer"] != "loop, both copies":
        names.add("embed.weight" if spec["write"] == "max_norm" else "head.weight")
    return sorted(names)


def fixes():
    """GENERATED_FIXES: {index: the checker's findings} as JSON, for a run of those models
    with the fixes applied; none by default."""
    return {int(i): f for i, f in json.loads(os.environ.get("GENERATED_FIXES", "{}")).items()}


def indices():
    """Which models this run trains: those of GENERATED_FIXES, or GENERATED_MODELS=
    first:count or a list like 4,7; by default the sample."""
    if fixes():
        return sorted(fixes())
    chosen = os.environ.get("GENERATED_MODELS", SAMPLE)
    if ":" in chosen:  # pragma: no cover - the benchmark's ranges
        first, _, count = chosen.partition(":")
        return range(int(first), int(first) + int(count))
    return [int(index) for index in chosen.split(",")]


def same_message(error):
    error = re.sub(r"'id': \d+", "'id': …", error)
    return re.sub(r"'active_sub_modules': \{[\d, ]*\}", "'active_sub_modules': {…}", error)


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    results = {}
    fixed = fixes()
    for index in indices():
        spec = draw(index)
        results[index] = {"spec": spec, "zero3": train_zero3(spec, fixed.get(index, ())),
                          "plain": train_plain(spec), "affected": affected(spec)}
    if torch.distributed.get_rank() == 0:
        errors = [r["zero3"] for r in results.values() if "error" in r["zero3"]]
        how = " with the checker's fixes" if fixed else ""
        print(f"{len(results)} generated models trained under ZeRO-3{how}; "
              f"{len(errors)} raised an error:")
        # One line each: a load error's line breaks and tabs as one space, and ZeRO-3's
        # AssertionError once, its ids (which differ from model to model) as "…"
        shown = {(e["where"], same_message(" ".join(e["error"].split()))) for e in errors}
        for where, error in sorted(shown):
            print(f"- {where}: `{error}`")
    torch.distributed.destroy_process_group()
    return results


def checker():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import check_shared_reads

    return check_shared_reads


def checker_verdicts():
    """check_shared_reads.py on the same models: {index: (spec, findings as dicts)}."""
    check_shared_reads = checker().check_shared_reads
    verdicts = {}
    for index in indices():
        spec = draw(index)
        torch.manual_seed(SEED)
        findings = check_shared_reads(
            lambda: Model(spec), make_batch(0),
            loop=lambda engine, batch: loss_of(engine, batch, spec), steps=STEPS)
        verdicts[index] = (spec, [vars(finding) for finding in findings])
    return verdicts


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
