"""Check your model: every read of a parameter that ZeRO-3 did not gather, with the fix.

It builds the model under `deepspeed.zero.Init` and trains a few steps under real ZeRO-3
(every parameter partitioned), in this process, as one rank over gloo on the CPU. Instead of
stopping at the first failure, it watches every operation: an operation that gets a
parameter ZeRO-3 has not gathered is recorded, the parameter is gathered so that the step can
go on, and the run continues. Copy this file next to your model, or run it:

    python snippets/zero3/check_shared_reads.py path/to/file.py:factory

`factory` is a function of that file returning `(build, inputs)` or `(build, inputs, loop)`
(see `check_shared_reads`). The command prints a table and exits with 1 when it found
anything, so it can run in your CI. Without arguments it checks its own example, a model
that reads its embedding weight through a list (and exits with 0):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 snippets/zero3/check_shared_reads.py
Run and tested here on CPU only; not run on GPUs.
"""
from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks an accelerator

import importlib.util  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.zero import parameter_offload  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

OUTSIDE = "(outside any forward)"
ROOT_NAME = "(model)"  # the reader when the model's own forward reads the weight
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 0.0,
}
# Reading these needs no values: they are right on a partitioned parameter too.
METADATA = {"dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout",
            "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "_version",
            "requires_grad_", "__hash__", "name", "_backward_hooks", "is_floating_point",
            "is_complex", "element_size", "get_device", "_is_view", "register_hook",
            "_post_accumulate_grad_hooks", "register_post_accumulate_grad_hook", "__eq__"}
_DEEPSPEED_DIR = str(Path(deepspeed.__file__).parent)
_DEEPSPEED_LINEAR = str(Path(deepspeed.__file__).parent / "runtime" / "zero" / "linear.py")
_TORCH_DIR = str(Path(torch.__file__).parent)


@dataclass(frozen=True)
class Finding:
    parameter: str  # qualified name, e.g. "embeddings.weight"
    reader: str  # module whose forward was running, "(model)", or "(outside any forward)"
    phase: str  # "constructor", "forward", "backward" or "loop"
    step: int | None  # None in the constructor
    fix: str  # the line to add, and where


def _from_deepspeed(frame) -> bool:
    """Whether the operation was called by DeepSpeed's own code (gathering, partitioning)
    rather than by the model, the loop or autograd."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_DEEPSPEED_LINEAR):
            pass  # ZeRO-3's stand-in for F.linear computes for the model: look further up
        elif name.startswith(_DEEPSPEED_DIR):
            return True
        if name.startswith(_TORCH_DIR):
            if frame.f_code.co_name in ("_engine_run_backward", "backward", "apply"):
                return False  # autograd runs the recorded operations
        elif not name.startswith("<"):
            return False  # model code, or the reader's loop
        frame = frame.f_back
    return False


def _unavailable(args, kwargs):
    flat, _ = tree_flatten((args, kwargs or {}))
    return [a for a in flat if isinstance(a, torch.Tensor) and hasattr(a, "ds_id")
            and a.ds_status != ZeroParamStatus.AVAILABLE]


def _gather(param):
    if param.ds_status == ZeroParamStatus.INFLIGHT:
        param.ds_active_sub_modules.add(-1)  # keep it; wait below
    param.all_gather()


class _Watch:
    """What the checker knows while it runs: the phase, the step, the model's names."""

    def __init__(self):
        self.phase, self.step, self.root = "constructor", None, None
        self.seen = {}  # (param id, reader, phase) -> raw record
        self.gathered = {}  # param id -> param, gathered by the checker in this step
        self.missed = set()  # ids of the parameters whose reads the checker recorded
        self.last_reader = {}  # param id -> (reader module, or None)
        self.running = []  # modules whose forward has started and not returned

    def running_module(self):
        """The module ZeRO-3 registers a read on (the top of its stack of running
        modules), or None outside every forward."""
        if not self.running:
            return None
        stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
        return stack[-1] if stack else self.running[-1]

    def hooks(self):
        """Global forward hooks: which forwards are running (any entry path)."""
        def started(module, args):
            # A parameter passed on as an argument: DeepSpeed's hooks hand the callee a
            # new tensor, so catch it here, before them (global hooks run first).
            # The callee's hooks gather its own and its registered parameters.
            own = {id(p) for p in module._parameters.values()} | {
                id(p) for p in getattr(module, "_external_params", {}).values()}
            for param in _unavailable(args, None):
                if id(param) not in own:
                    self.record(param, sys._getframe(1))
            self.running.append(module)

        def ended(module, args, output):
            self.running.pop()

        modules = torch.nn.modules.module
        return [modules.register_module_forward_pre_hook(started),
                modules.register_module_forward_hook(ended, always_call=True),
                _FunctionApplyWatch(self)]

    def before_accumulate(self, param):
        """Before autograd adds a gradient to `param`: a parameter whose read the checker
        gathered may have been partitioned again by ZeRO-3 since (its owner's forward or
        backward ended; in a later step, its prefetch made the read work), and autograd
        shapes the gradient after the parameter. Not a read of the model's: gather it
        again, so that the step goes on, and record nothing."""
        if id(param) in self.missed and param.ds_status != ZeroParamStatus.AVAILABLE:
            self.gather(param)

    def record(self, param, frame, backward=False):
        module = None if self.phase == "constructor" else self.running_module()
        if backward and self.phase == "backward":
            module = self.last_reader.get(id(param), module)
        phase = self.phase
        if phase == "loop" and module is not None:
            phase = "forward"
        key = (id(param), id(module), phase)
        if key not in self.seen:
            self.seen[key] = (param, module, phase, self.step, _constructor_of(frame))
        self.missed.add(id(param))
        if param.ds_status != ZeroParamStatus.AVAILABLE:
            self.gather(param)

    def gather(self, param):
        _gather(param)
        self.gathered[id(param)] = param

    def note_use(self, args, kwargs):
        """Remember which forward last computed with each gathered parameter (for backward)."""
        if self.phase == "constructor":
            return
        module = self.running_module()
        flat, _ = tree_flatten((args, kwargs or {}))
        for a in flat:
            if isinstance(a, torch.Tensor) and hasattr(a, "ds_id"):
                self.last_reader[id(a)] = module

    def release(self):
        """Partition again what the checker gathered, as ZeRO-3 would after the use."""
        for param in self.gathered.values():
            param.ds_active_sub_modules.discard(-1)
            if param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_active_sub_modules:
                param.partition()
        self.gathered.clear()


def _constructor_of(frame):
    """The innermost module whose __init__ is on the stack (for constructor findings)."""
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                return owner
        frame = frame.f_back
    return None


class _FunctionApplyWatch:
    """Sees the parameters given to a custom autograd Function (ZeRO-3's stand-in for
    F.linear is one): the Function takes its inputs' shapes when it is called, before the
    operations inside it run, so a parameter must be gathered before the call."""

    def __init__(self, watch):
        self.watch = watch
        self.original = torch.autograd.Function.__dict__["apply"]
        original = self.original.__func__

        def apply(cls, *args, **kwargs):
            missing = _unavailable(args, kwargs)
            if missing and not _from_deepspeed(sys._getframe(1)):
                for param in missing:
                    watch.record(param, sys._getframe(1))
            return original(cls, *args, **kwargs)

        torch.autograd.Function.apply = classmethod(apply)

    def remove(self):
        torch.autograd.Function.apply = self.original


class _FunctionWatch(TorchFunctionMode):
    """Sees each torch operation with the Parameter objects it was given."""

    def __init__(self, watch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _op_name(func) not in METADATA:
            missing = _unavailable(args, kwargs)
            if missing and not _from_deepspeed(sys._getframe(1)):
                for param in missing:
                    self.watch.record(param, sys._getframe(1))
        self.watch.note_use(args, kwargs)
        return func(*args, **(kwargs or {}))


def _op_name(func):
    """`matmul` for torch.matmul; `data` or `shape` for the getter of `param.data`, ..."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class _DispatchWatch(TorchDispatchMode):
    """In backward: sees the operations autograd runs, with the tensors it saved."""

    def __init__(self, watch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        missing = _unavailable(args, kwargs)
        if missing and not _from_deepspeed(sys._getframe(1)):
            for param in missing:
                self.watch.record(param, sys._getframe(1), backward=True)
        return func(*args, **(kwargs or {}))


def _default_loop(engine, inputs):
    output = engine(*inputs)
    if isinstance(output, dict):  # a Hugging Face output: its loss, or its first tensor
        output = output.get("loss") if output.get("loss") is not None else next(
            v for v in output.values() if isinstance(v, torch.Tensor))
    elif isinstance(output, (tuple, list)):
        output = output[0]
    return output.float().pow(2).mean()


def _start_process_group():
    if torch.distributed.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ[key] = value
    # The CPU accelerator (DS_ACCELERATOR=cpu, set above unless you chose another): gloo.
    backend = get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return True


def check_shared_reads(build, inputs, loop=None, steps=3):
    """Train `steps` steps of `build()` under ZeRO-3; every use of a parameter ZeRO-3 had not
    gathered, as a list of Finding (empty: ZeRO-3 gathered every read).

    build: zero-argument callable returning the model (called inside deepspeed.zero.Init).
    inputs: tuple of the model's positional arguments.
    loop: optional loop(engine, inputs) -> loss, for steps that do more than engine(*inputs).
    """
    loop = loop or _default_loop
    started = _start_process_group()
    watch = _Watch()
    errors = []
    handles = watch.hooks()
    try:
        model = _build(build, watch, errors)
        if model is not None:
            _train(model, inputs, loop, steps, watch, errors)
    finally:
        for handle in handles:
            handle.remove()
        if started:  # DeepSpeed's own call also forgets the groups it cached
            deepspeed.comm.destroy_process_group()
    return _findings(watch, errors)


def _build(build, watch, errors):
    try:
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG), _FunctionWatch(watch):
            model = build()
    except Exception as error:  # noqa: BLE001 - an error while building is a finding
        errors.append(("constructor", None, error))
        return None
    finally:
        watch.release()
    watch.root = model
    return model


def _train(model, inputs, loop, steps, watch, errors):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    for param in model.parameters():
        if param.requires_grad:  # runs before autograd accumulates the gradient
            param.register_hook(lambda grad, param=param: watch.before_accumulate(param))
    for step in range(steps):
        watch.step = step
        try:
            watch.phase = "loop"
            with _FunctionWatch(watch):
                loss = loop(engine, inputs)
            watch.phase = "backward"
            with _FunctionWatch(watch), _DispatchWatch(watch):
                engine.backward(loss)
            watch.release()
            engine.step()
        except Exception as error:  # noqa: BLE001 - what the checker could not gather
            errors.append((watch.phase, step, error))
            return
        finally:
            watch.phase = "loop"


def _names(root):
    names = {}
    if root is not None:
        for name, param in root.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
    return names


def _module_names(root):
    return {id(m): name for name, m in root.named_modules()} if root is not None else {}


def _findings(watch, errors):
    params, modules = _names(watch.root), _module_names(watch.root)
    found = []
    for param, module, phase, step, init_owner in watch.seen.values():
        name = params.get(id(param)) or _name_in(init_owner, param) or f"ds_id {param.ds_id}"
        reader = OUTSIDE if module is None else (modules.get(id(module)) or ROOT_NAME)
        fix = _fix(watch.root, param, name, module, phase, init_owner)
        found.append(Finding(name, reader, phase, step, fix))
    for phase, step, error in errors:
        found.append(Finding("(unknown)", OUTSIDE, phase, step,
                             f"the run raised {type(error).__name__}: {error}"))
    return found


def _name_in(module, param):
    if module is None:
        return None
    for name, p in module.named_parameters(remove_duplicate=False):
        if p is param:
            return f"{type(module).__name__}.{name}"
    return None


def _fix(root, param, name, module, phase, init_owner):
    if phase == "constructor":
        where = f"{type(init_owner).__name__}.__init__" if init_owner else "the constructor"
        return (f"in {where}: read or change it inside `with deepspeed.zero.GatheredParameters("
                f"<{name}>, modifier_rank=0):`, or take its shape from `.ds_shape`")
    if module is None:
        if phase == "backward":
            return ("autograd needs its values after the `GatheredParameters` block: move the "
                    "computation into a forward (a submodule called through the engine)")
        return (f"in the training loop: read it inside `with deepspeed.zero.GatheredParameters("
                f"engine.module.{name})`, or move the computation into a forward")
    holder, path = _common_holder(root, module, name)
    target = "self" if holder is module else f"self.{_path_from(holder, module)}"
    return (f"`deepspeed.zero.register_external_parameter({target}, self.{path})` in "
            f"`{type(holder).__name__}.__init__`")


def _common_holder(root, module, name):
    """The innermost module that contains both the reader and the parameter."""
    owner_path = name.split(".")[:-1]
    module_path = {id(m): n for n, m in root.named_modules()}.get(id(module), "")
    module_parts = module_path.split(".") if module_path else []
    common = []
    for a, b in zip(owner_path, module_parts):
        if a != b:
            break
        common.append(a)
    holder = root.get_submodule(".".join(common)) if common else root
    return holder, ".".join(name.split(".")[len(common):])


def _path_from(holder, module):
    for name, m in holder.named_modules():
        if m is module:
            return name
    return "?"


def print_table(findings, out=sys.stdout):
    if not findings:
        print("No findings: ZeRO-3 gathered every parameter this model read.", file=out)
        return
    print(f"{len(findings)} read(s) that ZeRO-3 did not gather:", file=out)
    rows = [("parameter", "reader", "phase", "step", "fix")] + [
        (f.parameter, f.reader, f.phase, "-" if f.step is None else str(f.step), f.fix)
        for f in findings]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4],
              file=out)


def _load(target):
    path, _, factory = target.rpartition(":")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).resolve().parent))
    spec.loader.exec_module(module)
    return getattr(module, factory)()


class Example(torch.nn.Module):
    """What the command checks without arguments: the weight is read through a list."""

    def __init__(self):
        super().__init__()
        self.embeddings = torch.nn.Embedding(16, 8)
        self.tied = [self.embeddings.weight]  # a list is not a submodule

    def forward(self, tokens):
        return self.embeddings(tokens) @ self.tied[0].t()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        tokens = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
        print_table(check_shared_reads(Example, (tokens,)))
        return 0
    if len(argv) != 1 or ":" not in argv[0]:
        print(__doc__, file=sys.stderr)
        return 2
    findings = check_shared_reads(*_load(argv[0]))
    print_table(findings)
    return 1 if findings else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(code)  # no interpreter shutdown, which gloo's threads can abort
