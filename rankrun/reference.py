"""The reference a ZeRO-3 example is compared with: the same model, seed, data and optimizer,
trained in this one process without DeepSpeed; and example_namespace, which loads an example's
definitions into this process to build it (the tests' and benchmarks' one way to load one)."""

import contextlib
import math
import runpy
import sys
from pathlib import Path

import torch

from rankrun.project import ROOT
from rankrun.tolerance import assert_matches


def example_namespace(snippet, with_siblings=()) -> dict:
    """The definitions of an example (a path relative to the repository root, or absolute), its
    main block not run: the module's globals, as `runpy` leaves them, for building its reference.

    The example imports its siblings (the modules in its folder) as it does when run as a
    script (see imports_as_a_script); `with_siblings` names siblings it imported whose globals
    to add, under its own: example_namespace("snippets/transformers/zero3_saves.py",
    with_siblings=["tied_causal_lm"])["LR"] is tied_causal_lm.py's LR."""
    path = ROOT / snippet
    with imports_as_a_script(path) as siblings:
        namespace = runpy.run_path(str(path), run_name="reference")
    added = {}
    for name in with_siblings:
        added.update(vars(siblings[name]))
    return {**added, **namespace}


@contextlib.contextmanager
def imports_as_a_script(script: Path):
    """While the block runs, `import NAME` finds the modules of `script`'s folder as `python
    script` finds them (its folder first on sys.path, as rankrun/rank_main.py sets it for a
    rank), not a module of that name imported earlier, from another folder of snippets say.
    Afterwards sys.path and sys.modules are as they were: the siblings imported meanwhile are
    dropped from sys.modules (two folders may each have a module of the same name); the dict
    the `with` binds holds them by name once the block has ended."""
    folder = script.resolve().parent
    names = {path.stem for path in folder.glob("*.py")} | {path.parent.name for path in folder.glob("*/__init__.py")}
    saved_path = list(sys.path)
    shadowed = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    before = set(sys.modules)
    siblings = {}
    sys.path.insert(0, str(folder))
    try:
        yield siblings
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - before:
            file = getattr(sys.modules[name], "__file__", None)
            if file and Path(file).resolve().is_relative_to(folder):
                siblings[name] = sys.modules.pop(name)
        sys.modules.update(shadowed)


def train_in_one_process(model, batches, loss_fn, lr):
    """Plain SGD over `batches` of (inputs, targets); the loss and every full gradient of each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for inputs, targets in batches:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def assert_same_training(got, reference, label=""):
    """The losses, and at every step the full gradient of every parameter (shapes included), agree
    with the reference under the project's tolerance policy (rankrun.tolerance). `got` is what an
    example's main() returned."""
    losses, grads = reference
    assert_matches(got["losses"], losses, f"{label} losses")
    assert len(got["grads"]) == len(grads), label
    for step, (got_step, want_step) in enumerate(zip(got["grads"], grads)):
        assert_matches(got_step, want_step, f"{label} step {step} grads")


def train_gpipe_in_one_process(example, model, weight):
    """A torch.distributed.pipelining example trained in one process: SGD with its LR on its
    batch(), each of its STEPS steps the mean of the losses of its MICRO_BATCHES micro-batches
    (as GPipe accumulates them). Returns the step losses and `weight`'s gradient in step 0."""
    optimizer = torch.optim.SGD(model.parameters(), lr=example["LR"])
    tokens, targets = example["batch"]()
    micro_batches = example["MICRO_BATCHES"]
    losses, first_grad = [], None
    for _ in range(example["STEPS"]):
        total = 0.0
        for x, y in zip(tokens.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
            loss = example["cross_entropy"](model(x), y)
            (loss / micro_batches).backward()
            total += loss.item()
        if first_grad is None:
            first_grad = weight.grad.clone()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / micro_batches)
    return losses, first_grad


def gradient_norm(parameters):
    """The L2 norm of the parameters' gradients together, in float64 (what clipping divides by)."""
    return math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in parameters))


def layers_seeded_like_deepspeed(base_seed, builders):
    """Build the layers as DeepSpeed's PipelineModule(seed_layers=True, base_seed=...) does:
    layer i right after torch.manual_seed(base_seed + i). `builders` maps each layer index to
    what builds it (a tied module is built at its first use); returns the built layers in order."""
    layers = []
    for index, build in builders.items():
        torch.manual_seed(base_seed + index)
        layers.append(build())
    return layers


def backward_over_micro_batches(micro_batches, loss_of):
    """Gradient accumulation as a pipeline schedule does it, in one process: the backward of each
    micro-batch's loss divided by their number. `loss_of(inputs, targets)` gives one loss;
    returns the mean loss (what the pipeline reports for the step)."""
    micro_batches = list(micro_batches)
    total = 0.0
    for inputs, targets in micro_batches:
        loss = loss_of(inputs, targets)
        (loss / len(micro_batches)).backward()
        total += loss.item()
    return total / len(micro_batches)


def train_causal_lm_in_one_process(model, initial, batches, lr):
    """A Hugging Face causal LM trained with plain SGD from the weights `initial` (name ->
    full tensor, as an example gathered them under ZeRO-3): each step's loss (the model's own,
    labels = inputs) and every full gradient."""
    with torch.no_grad():
        parameters = dict(model.named_parameters())
        assert parameters.keys() == initial.keys(), (sorted(parameters), sorted(initial))
        for name, parameter in parameters.items():
            parameter.copy_(initial[name])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for tokens in batches:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def train_tied_pipeline_in_one_process(fresh_optimizer_after=None):
    """snippets/pipeline/deepspeed_tied_checkpoint.py's model in one process: one embedding as
    input layer and head, layer i built after torch.manual_seed(SEED + i) as seed_layers=True
    does, Adam with the snippet's LR,
    each step the mean over its micro-batches. With `fresh_optimizer_after=n`, Adam starts
    anew after n steps (what loading without the optimizer state does)."""
    ex = example_namespace("snippets/pipeline/deepspeed_tied_checkpoint.py")
    embedding, mixer1, mixer2 = layers_seeded_like_deepspeed(ex["SEED"], {
        0: lambda: torch.nn.Embedding(ex["VOCAB"], ex["DIM"]), 1: ex["Mixer"], 2: ex["Mixer"]})
    params = [*embedding.parameters(), *mixer1.parameters(), *mixer2.parameters()]
    optimizer = torch.optim.Adam(params, lr=ex["LR"])
    losses = []
    for step in range(ex["STEPS"]):
        if step == fresh_optimizer_after:
            optimizer = torch.optim.Adam(params, lr=ex["LR"])
        losses.append(backward_over_micro_batches(ex["micro_batches"](step), lambda tokens, targets: ex["cross_entropy"](
            ex["logits_from_embedding"](embedding, mixer2(mixer1(embedding(tokens)))), targets)))
        optimizer.step()
        optimizer.zero_grad()
    return losses, embedding.weight.detach().clone()


def train_checkpoint_example_in_one_process(ex, name):
    """snippets/zero3/zero3_checkpoint.py's model `name`, batches and SGD in one process (`ex`:
    the snippet's namespace): the losses of all STEPS steps and the weights after SAVED_AFTER and after SAVED_AFTER + 1 steps (names as state_dict has them)."""
    torch.manual_seed(ex["SEED"])
    model = ex["MODELS"][name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    losses, weights = [], {}
    for step in range(ex["STEPS"]):
        if step in (ex["SAVED_AFTER"], ex["SAVED_AFTER"] + 1):
            weights[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        inputs, targets = ex["make_batch"](step)
        loss = ex["loss_of"](model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, weights


def train_adapter_in_one_process(model, batches, lr):
    """A Hugging Face causal LM with frozen weights (a PEFT model) trained with plain SGD on the
    parameters that require a gradient, as Trainer's optim="sgd" with a constant LR and no
    clipping does: each step's loss (the model's own, labels = inputs). The model is trained in
    place."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for tokens in batches:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# The automatic-detection page's rule, written out for the cases of its tables
# (snippets/zero3/automatic_detection.py): without registration a read is detected when it goes
# through the owning module's attribute (its parameter dictionary) ...
THROUGH_THE_MODULE = {
    "`self.embeddings.weight`",
    '`getattr(self.embeddings, "weight")`',
    "a list holding the module: `self.owners[0].weight`",
}
# ... and the weight is not read before the owner's forward ran in the step.
MATMUL_ERROR = "RuntimeError: size mismatch, got input (10), mat (10x8), vec (0)"
LOOKUP_ERROR = "RuntimeError: 'weight' must be 2-D"
OUTSIDE_ERROR = "IndexError: Dimension out of range (expected to be in range of [-1, 0], but got 1)"
INDEX_ERROR = "IndexError: index 0 is out of bounds for dimension 0 with size 0"
OTHERS = {  # row: (without registration, with registration); None means "equals plain PyTorch"
    "a submodule returns its own parameter: `self.embeddings()`": (None, None),
    "a shared Parameter: `lm_head.weight = embeddings.weight`": (None, None),
    "`engine.module(tokens)` instead of `engine(tokens)`": (None, None),
    "read outside any forward, in the training loop": (("in step 0", OUTSIDE_ERROR),) * 2,
    "changed in a constructor, after `zero.Init` partitioned it": ("silently wrong",) * 2,
    "indexed in a constructor, after `zero.Init` partitioned it": (("while building the model", INDEX_ERROR),) * 2,
}


def predicted_outcome(example, key, register):
    """What the automatic-detection page's rule predicts for one case of its tables (a key of
    automatic_detection.py's `cases()`), with or without registration: None (the run equals
    plain PyTorch), 'silently wrong', or (where, message)."""
    if len(key) == 1:
        return OTHERS[key[0]][register]
    read, when, use = key
    if register or (read in THROUGH_THE_MODULE and when != "before"):
        return None
    return ("in step 0", MATMUL_ERROR if use == example["FIRST_USE"] else LOOKUP_ERROR)
