"""Check your model: every read of a parameter that ZeRO-3 did not gather, every weight it
leaves empty or loses (a copy of a partitioned layer, a write into a gathered weight), with
the fix.

It builds the model under `deepspeed.zero.Init` and trains a few steps under real ZeRO-3
(every parameter partitioned), in this process, as one rank over gloo on the CPU. Instead of
stopping at the first failure, it watches every operation: an operation that gets a
parameter ZeRO-3 has not gathered is recorded, the parameter is gathered so that the step can
go on, and the run continues; so is an operation that writes into a weight ZeRO-3 gathered.
It also builds the model without DeepSpeed from the same seed, and names every weight whose
start value differs. Copy this file next to your model, or run it:

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

import contextlib  # noqa: E402
import copy  # noqa: E402
import importlib.util  # noqa: E402
import linecache  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import textwrap  # noqa: E402
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
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_COPY_FILE = copy.__file__
_THIS_FILE = __file__


@dataclass(frozen=True)
class Finding:
    parameter: str  # its path in the model, e.g. "embeddings.weight" (or where it is held)
    reader: str  # module whose forward was running, "(model)", or "(outside any forward)"
    phase: str  # "constructor", "forward", "backward" or "loop"
    step: int | None  # None in the constructor
    fix: str  # one line of Python to add
    where: str  # where that line goes
    # "use": a use of a parameter ZeRO-3 had not gathered; "copy": an empty copy of a
    # partitioned parameter; "empty": a parameter made from a partitioned one, with nothing
    # in it; "changed": a start value other than plain PyTorch's; "write": a write to a
    # gathered weight, which ZeRO-3 discards
    kind: str = "use"


def _from_deepspeed(frame) -> bool:
    """Whether the operation was called by DeepSpeed's own code (gathering, partitioning)
    rather than by the model, the loop or autograd."""
    inner = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_DEEPSPEED_LINEAR):
            pass  # ZeRO-3's stand-in for F.linear computes for the model: look further up
        elif name.startswith(_DEEPSPEED_DIR):
            if inner is None or inner.f_code.co_name != "__init__":
                return True
            # zero.Init's wrapper around a module's __init__ (torch's own modules too):
            # what that __init__ does is the model's
        if name.startswith(_TORCH_DIR):
            if frame.f_code.co_name in ("_engine_run_backward", "backward", "apply"):
                return False  # autograd runs the recorded operations
        elif not name.startswith("<"):
            return False  # model code, or the reader's loop
        inner, frame = frame, frame.f_back
    return False


def _tensors(args, kwargs):
    flat, _ = tree_flatten((args, kwargs or {}))
    return [a for a in flat if isinstance(a, torch.Tensor)]


def _gather(param):
    if param.ds_status == ZeroParamStatus.INFLIGHT:
        param.ds_active_sub_modules.add(-1)  # keep it; wait below
    param.all_gather()


@dataclass
class _Use:
    """One use the checker saw (the first of its parameter, reader and phase)."""
    param: torch.nn.Parameter
    module: torch.nn.Module | None  # the reader
    phase: str
    step: int | None
    init_owner: torch.nn.Module | None  # innermost __init__ running, in the constructor
    site: str  # "file.py:line" of the user's code that made the use
    needs_grad: bool = False  # autograd recorded it: backward reads the values again
    hf_init: bool = False  # inside Transformers' weight initialisation
    # In the constructor: whether an operation changed the (gathered) values, the innermost
    # __init__ of the user's own code, and the library's line that made the change when a
    # library module's __init__ made it (torch's MultiheadAttention zeroing a child's bias).
    changed: bool = False
    user_owner: torch.nn.Module | None = None
    library_line: str | None = None


@dataclass
class _Copy:
    """A Parameter copy.deepcopy made while the model was built."""
    original: torch.nn.Parameter
    copied: object  # what was given to copy.deepcopy: a module, usually
    site: str  # the user's line behind the copy
    source: str | None  # how that line's code names what was copied: "layer", "self.block"
    path: str  # the original's path in what was copied ("self_attn.in_proj_weight")
    owner: torch.nn.Module | None  # the user's __init__ that made the copy


@dataclass
class _Write:
    """A write to a weight while ZeRO-3 had it gathered, after deepspeed.initialize."""
    param: torch.nn.Parameter
    module: torch.nn.Module | None  # the forward that wrote it, or None (the loop)
    phase: str
    step: int
    site: str
    op: str  # "embedding_renorm_", ...
    modifying: bool  # inside GatheredParameters(..., modifier_rank=...)


class _Watch:
    """What the checker knows while it runs: the phase, the step, the model's names."""

    def __init__(self):
        self.phase, self.step, self.root = "constructor", None, None
        self.seen = {}  # (param id, reader id, phase) -> _Use
        self.gathered = {}  # param id -> param, gathered by the checker in this step
        self.missed = set()  # ids of the parameters whose uses the checker recorded
        self.last_reader = {}  # param id -> (reader module, or None)
        self.running = []  # modules whose forward has started and not returned
        self.created = {}  # param id -> (module it was registered on, "file:line")
        self.copies = {}  # id of a copy made by copy.deepcopy in the constructor -> _Copy
        self.made_at = {}  # param id -> (site, user __init__'s module) where it was registered
        self.site_uses = {}  # constructor site -> the partitioned parameters used there
        self.writes = []  # _Write: writes to gathered weights in this step
        self.lost_writes = {}  # (param id, writer id, phase) -> the first such _Write
        self.fp32_set = set()  # ids given to safe_set_full_fp32_param in this step
        self.modifying = {}  # param id -> depth of GatheredParameters(modifier_rank=...) blocks
        self.backward_ran = False
        self.as_zero3_builds_it = self.as_plain_builds_it = None  # full weights by name

    def unavailable(self, args, kwargs):
        """The ZeRO-3 parameters among the arguments that ZeRO-3 has not gathered. In the
        constructor, also those only the checker gathered: a real run has them partitioned."""
        found = []
        for a in _tensors(args, kwargs):
            # (the optimizer's fp32 partitions carry a ds_id too, but no status)
            if hasattr(a, "ds_status") and (a.ds_status != ZeroParamStatus.AVAILABLE or (
                    self.phase == "constructor" and id(a) in self.gathered)):
                found.append(a)
        return found

    def running_module(self):
        """The module ZeRO-3 registers a read on (the top of its stack of running
        modules), or None outside every forward."""
        if not self.running:
            return None
        stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
        return stack[-1] if stack else self.running[-1]

    def hooks(self):
        """Global hooks: which forwards are running (any entry path), and where each
        parameter was created (for one the model does not hold in its module tree)."""
        def started(module, args):
            # A parameter passed on as an argument: DeepSpeed's hooks hand the callee a
            # new tensor, so catch it here, before them (global hooks run first).
            # The callee's hooks gather its own and its registered parameters.
            own = {id(p) for p in module._parameters.values()} | {
                id(p) for p in getattr(module, "_external_params", {}).values()}
            for param in self.unavailable(args, None):
                if id(param) not in own:
                    self.record(param, sys._getframe(1))
            self.running.append(module)

        def ended(module, args, output):
            self.running.pop()

        def registered(module, name, param):
            if param is not None and id(param) not in self.created:
                self.created[id(param)] = (param, module, _creation_site(module))
            if param is not None and self.phase == "constructor":
                frame = sys._getframe(1)
                self.made_at[id(param)] = (_site(frame, "constructor"),
                                           _user_constructor_of(frame))

        modules = torch.nn.modules.module
        return [modules.register_module_forward_pre_hook(started),
                modules.register_module_forward_hook(ended, always_call=True),
                modules.register_module_parameter_registration_hook(registered),
                _FunctionApplyWatch(self)]

    def before_accumulate(self, param):
        """Before autograd adds a gradient to `param`: a parameter whose read the checker
        gathered may have been partitioned again by ZeRO-3 since (its owner's forward or
        backward ended; in a later step, its prefetch made the read work), and autograd
        shapes the gradient after the parameter. Not a read of the model's: gather it
        again, so that the step goes on, and record nothing."""
        if id(param) in self.missed and param.ds_status != ZeroParamStatus.AVAILABLE:
            self.gather(param)

    def record(self, param, frame, backward=False, needs_grad=False):
        module = None if self.phase == "constructor" else self.running_module()
        if backward and self.phase == "backward":
            module = self.last_reader.get(id(param), module)
        phase = self.phase
        if phase == "loop" and module is not None:
            phase = "forward"
        key = (id(param), id(module), phase)
        if key not in self.seen:
            self.seen[key] = _Use(param, module, phase, self.step, _constructor_of(frame),
                                  _site(frame, phase), hf_init=_in_hf_init(frame),
                                  user_owner=_user_constructor_of(frame))
        self.seen[key].needs_grad |= needs_grad
        # Transformers' initialisation may write a weight a constructor used before
        # (torch's MultiheadAttention): from_config then initializes it gathered.
        self.seen[key].hf_init |= _in_hf_init(frame)
        if phase == "constructor":
            used = self.site_uses.setdefault(self.seen[key].site, [])
            if not any(p is param for p in used):
                used.append(param)
        self.missed.add(id(param))
        if param.ds_status != ZeroParamStatus.AVAILABLE:
            self.gather(param)

    def gather(self, param):
        _gather(param)
        self.gathered[id(param)] = param

    def wrote(self, param, func, frame):
        """A write to a gathered weight (see _WriteWatch); judged at the end of the step."""
        module = self.running_module()
        phase = "forward" if module is not None else self.phase
        op = getattr(func, "__name__", str(func)).split(".")[0]
        op = ".data =" if op == "__set__" else op
        self.writes.append(_Write(param, module, phase, self.step, _site(frame, phase), op,
                                  self.modifying.get(id(param), 0) > 0))

    def end_step(self):
        """The step's writes that ZeRO-3 discards: every write in a forward; in the loop,
        every one not made on both copies (see _KeptWritesWatch)."""
        for write in self.writes:
            kept = (write.module is None and write.modifying
                    and id(write.param) in self.fp32_set)
            key = (id(write.param), id(write.module), write.phase)
            if not kept and key not in self.lost_writes:
                self.lost_writes[key] = write
        self.writes, self.fp32_set = [], set()

    def changed(self, param, frame):
        """An operation of the constructor changed `param` (gathered by the checker): in a
        real run the change goes into nothing. Keep where, for the finding."""
        use = self.seen.get((id(param), id(None), "constructor"))
        if use is None or use.changed:
            return
        use.changed, use.site = True, _site(frame, "constructor")
        use.init_owner, use.user_owner = _constructor_of(frame), _user_constructor_of(frame)
        use.library_line = _library_line(frame, use.init_owner)
        used = self.site_uses.setdefault(use.site, [])
        if not any(p is param for p in used):
            used.append(param)

    def note_use(self, args, kwargs):
        """Remember which forward last computed with each gathered parameter (for backward)."""
        if self.phase == "constructor":
            return
        module = self.running_module()
        for a in _tensors(args, kwargs):
            if hasattr(a, "ds_id"):
                self.last_reader[id(a)] = module

    def release(self):
        """Partition again what the checker gathered, as ZeRO-3 would after the use."""
        for param in self.gathered.values():
            param.ds_active_sub_modules.discard(-1)
            if param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_active_sub_modules:
                param.partition()
        self.gathered.clear()


def _constructor_of(frame, user=False):
    """The innermost module whose __init__ is on the stack (for constructor findings); with
    user=True, the innermost one whose __init__ is the user's code (not torch's)."""
    while frame is not None:
        if frame.f_code.co_name == "__init__" and not (
                user and _library(frame.f_code.co_filename)):
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                return owner
        frame = frame.f_back
    return None


def _user_constructor_of(frame):
    return _constructor_of(frame, user=True)


def _library_line(frame, owner):
    """When a library module's __init__ (torch's) made the operation: its line, as
    "activation.py:1242: `constant_(self.out_proj.bias, 0.0)`"; else None."""
    if owner is None:
        return None
    source = getattr(sys.modules.get(type(owner).__module__), "__file__", None)
    if source is None or not _library(source):
        return None
    while frame is not None:
        if frame.f_code.co_filename == source:
            text = linecache.getline(source, frame.f_lineno).strip()
            return f"{_where(frame)}: `{text}`"
        frame = frame.f_back
    return None


def _library(name):
    """Code that is not the user's: torch, DeepSpeed, this file, Python's own modules."""
    if name.startswith(_STDLIB_DIR) and not re.search(r"[/\\](site|dist)-packages[/\\]", name):
        return True  # copy.py, contextlib.py, ... (not packages installed beside them)
    return name.startswith((_DEEPSPEED_DIR, _TORCH_DIR, _THIS_FILE, "<"))


def _where(frame):
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def _site(frame, phase):
    """The line of the user's code behind a use: in the loop, the loop's own line that led
    to it; elsewhere, the first line outside torch, DeepSpeed and this file."""
    first = None
    while frame is not None:
        if phase in ("loop", "backward") and frame.f_back is not None and (
                frame.f_back.f_code is _run_loop.__code__):
            return _where(frame)
        if first is None and not _library(frame.f_code.co_filename):
            first = frame
        frame = frame.f_back
    return _where(first) if first is not None else "?"


def _creation_site(module):
    """Where `module` was created: the first line outside torch and DeepSpeed that is not
    in one of its own __init__ methods."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        own = code.co_name == "__init__" and frame.f_locals.get("self") is module
        if not own and not _library(code.co_filename):
            return _where(frame)
        frame = frame.f_back
    return "?"


def _in_hf_init(frame):
    """Whether Transformers' weight initialisation is on the stack."""
    while frame is not None:
        if frame.f_code.co_name in ("_init_weights", "_initialize_weights", "init_weights"):
            return True
        frame = frame.f_back
    return False


class _FunctionApplyWatch:
    """Sees the parameters given to a custom autograd Function (ZeRO-3's stand-in for
    F.linear is one): the Function takes its inputs' shapes when it is called, before the
    operations inside it run, so a parameter must be gathered before the call."""

    def __init__(self, watch):
        self.watch = watch
        self.original = torch.autograd.Function.__dict__["apply"]
        original = self.original.__func__

        def apply(cls, *args, **kwargs):
            missing = watch.unavailable(args, kwargs)
            if missing and not _from_deepspeed(sys._getframe(1)):
                grad = torch.is_grad_enabled() and any(
                    t.requires_grad for t in _tensors(args, kwargs))
                for param in missing:
                    watch.record(param, sys._getframe(1), needs_grad=grad)
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
        name = _op_name(func)
        before = []
        if name not in METADATA:
            missing = self.watch.unavailable(args, kwargs)
            frame = sys._getframe(1)
            if missing and not _from_deepspeed(frame):
                grad = torch.is_grad_enabled() and any(
                    t.requires_grad for t in _tensors(args, kwargs))
                for param in missing:
                    self.watch.record(param, frame, needs_grad=grad)
                if self.watch.phase == "constructor":  # did the operation change them?
                    before = [(p, p.detach().clone()) for p in missing]
        self.watch.note_use(args, kwargs)
        if name == "data" and getattr(func, "__name__", "") == "__set__" and args and (
                self.watch.phase != "constructor"):  # `weight.data = ...` replaces it
            weight = args[0]
            if getattr(weight, "ds_status", None) == ZeroParamStatus.AVAILABLE:
                frame = sys._getframe(1)
                if not _from_deepspeed(frame):
                    self.watch.wrote(weight, func, frame)
        result = func(*args, **(kwargs or {}))
        for param, values in before:
            if param.shape != values.shape or not torch.equal(param.detach(), values):
                self.watch.changed(param, frame)
        return result


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
        missing = self.watch.unavailable(args, kwargs)
        if missing and not _from_deepspeed(sys._getframe(1)):
            for param in missing:
                self.watch.record(param, sys._getframe(1), backward=True)
        return func(*args, **(kwargs or {}))


def default_loop(engine, inputs):
    """The loop without `loop=`: the model's loss, or the mean square of its output."""
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
    if "MASTER_PORT" not in os.environ:  # plain `python`: a group of one rank, on a free port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    # else torchrun's: its agent holds the rendezvous store at MASTER_PORT
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
    The checker calls engine.backward(loss), unless the loop called it itself (inside a
    GatheredParameters block, say).
    """
    loop = loop or default_loop
    started = _start_process_group()
    watch = _Watch()
    errors = []
    watch.as_zero3_builds_it, watch.as_plain_builds_it = _build_twice(build)
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


def _build_twice(build):
    """The model built as ZeRO-3 builds it (nothing gathered for it) and as plain PyTorch
    builds it, each from the random state the checked build starts from: their full
    weights by name (None for a build that raised). A use in the constructor counts when
    the two differ on its weight: ZeRO-3 lost what the constructor did."""
    state, built = torch.random.get_rng_state(), []
    for zero3 in (True, False):
        torch.random.set_rng_state(state)
        try:
            with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG, enabled=zero3):
                model = build()
            params = dict(model.named_parameters())
            with deepspeed.zero.GatheredParameters(list(params.values())):  # ZeRO-3 ones
                built.append({name: p.detach().clone() for name, p in params.items()})
        except Exception:  # noqa: BLE001 - a constructor that raises loses everything
            built.append(None)
    torch.random.set_rng_state(state)
    return built


class _DeepcopyWatch:
    """Sees every Parameter copy.deepcopy makes while the model is built (torch's
    nn.TransformerEncoder copies its layer so): under zero.Init, copying a partitioned
    parameter copies its empty data, and no __init__ runs for the copy to partition it."""

    def __init__(self, watch):
        self.watch, self.original = watch, torch.nn.Parameter.__deepcopy__

    def __enter__(self):
        original, watch = self.original, self.watch

        def deepcopy(param, memo):
            made = original(param, memo)
            if made is not param and hasattr(param, "ds_id"):
                watch.copies[id(made)] = _copy_of(param, sys._getframe(1))
            return made

        torch.nn.Parameter.__deepcopy__ = deepcopy
        return self

    def __exit__(self, *exc):
        torch.nn.Parameter.__deepcopy__ = self.original


def _copy_of(param, frame):
    """What the outermost copy.deepcopy on the stack was given, and the user's line."""
    copied = param
    while frame is not None:
        if frame.f_code.co_filename == _COPY_FILE and frame.f_code.co_name == "deepcopy":
            copied = frame.f_locals.get("x", copied)
        if not _library(frame.f_code.co_filename):
            break
        frame = frame.f_back
    site = _where(frame) if frame is not None else "?"
    path = ""
    if isinstance(copied, torch.nn.Module):
        path = _path_in(copied, param) or ""
    return _Copy(param, copied, site, _source_name(copied, frame), path,
                 _user_constructor_of(frame))


def _source_name(obj, frame):
    """How the code of `frame` can name `obj`: a local variable, or a path from `self`."""
    if frame is None:
        return None
    for name, value in frame.f_locals.items():
        if value is obj and name != "self":
            return name
    owner = frame.f_locals.get("self")
    if isinstance(owner, torch.nn.Module):
        for path, module in owner.named_modules():
            if module is obj and path:
                return _python_path(path)
        path = _path_in(owner, obj) if isinstance(obj, torch.Tensor) else None
        if path:
            return _python_path(path)
    return None


def _python_path(path, root="self"):
    """A path in a module as Python: "layers.0.weight" -> "self.layers[0].weight"."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", f"{root}.{path}" if path else root)


def _build(build, watch, errors):
    try:
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG), _FunctionWatch(watch), \
                _DeepcopyWatch(watch):
            model = build()
    except Exception as error:  # noqa: BLE001 - an error while building is a finding
        errors.append(("constructor", None, error))
        return None
    finally:
        watch.release()
    watch.root = model
    return model


def _run_loop(loop, engine, inputs):
    return loop(engine, inputs)


def _train(model, inputs, loop, steps, watch, errors):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    for param in model.parameters():
        if param.requires_grad:  # runs before autograd accumulates the gradient
            param.register_hook(lambda grad, param=param: watch.before_accumulate(param))
    backward = engine.backward

    def watched_backward(loss, *args, **kwargs):  # also when the loop calls it
        watch.phase, watch.backward_ran = "backward", True
        try:
            with _DispatchWatch(watch):
                return backward(loss, *args, **kwargs)
        finally:
            watch.phase = "loop"

    engine.backward = watched_backward
    with _KeptWritesWatch(watch, engine):
        for step in range(steps):
            watch.step, watch.backward_ran = step, False
            try:
                watch.phase = "loop"
                with _FunctionWatch(watch), _WriteWatch(watch):
                    loss = _run_loop(loop, engine, inputs)
                    if not watch.backward_ran:
                        engine.backward(loss)
                watch.release()
                watch.end_step()
                engine.step()
            except Exception as error:  # noqa: BLE001 - what the checker could not gather
                errors.append((watch.phase, step, error))
                return
            finally:
                watch.phase = "loop"


def _written(func, args, kwargs):
    """The tensors an operation writes into, by its schema (`Tensor(a!)`)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    written = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else (kwargs or {}).get(argument.name)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written


def _overlaps(a, b):
    """Whether two tensors' memory overlaps (a gathered weight may be a view of a buffer
    that holds other weights too)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    start_a, start_b = a.data_ptr(), b.data_ptr()
    return (start_a < start_b + b.numel() * b.element_size()
            and start_b < start_a + a.numel() * a.element_size())


class _WriteWatch(TorchDispatchMode):
    """Sees every operation that writes into a weight ZeRO-3 has gathered (in a forward,
    or in the loop): ZeRO-3 frees the gathered tensor at release, and the optimizer's copy
    of the weight wins at engine.step(), so such a write is lost. Operations DeepSpeed runs
    itself (gathering into the buffer, broadcasting) are left out."""

    def __init__(self, watch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        written = _written(func, args, kwargs)
        if written and self.watch.root is not None:
            with torch._C.DisableTorchFunction():  # no read of the model's: not watched
                hit = [p for p in self.watch.root.parameters()
                       if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE
                       and any(_overlaps(t, p.data) for t in written)]
            frame = sys._getframe(1)
            if hit and not _from_deepspeed(frame):
                for param in hit:
                    self.watch.wrote(param, func, frame)
        return func(*args, **(kwargs or {}))


class _KeptWritesWatch:
    """Which weights the loop changes on both of ZeRO-3's copies: inside
    GatheredParameters(..., modifier_rank=...) (the model's copy) and with
    safe_set_full_fp32_param (the optimizer's copy). Such a change is kept."""

    def __init__(self, watch, engine):
        self.watch, self.engine = watch, engine
        self.gathered = deepspeed.zero.GatheredParameters
        self.enter, self.exit = self.gathered.__enter__, self.gathered.__exit__

    def __enter__(self):
        watch, enter, exit_ = self.watch, self.enter, self.exit

        def entered(block):
            result = enter(block)
            if block.enabled and block.src_rank is not None:
                for param in block.params:
                    watch.modifying[id(param)] = watch.modifying.get(id(param), 0) + 1
            return result

        def exited(block, *exc):
            if block.enabled and block.src_rank is not None:
                for param in block.params:
                    watch.modifying[id(param)] -= 1
            return exit_(block, *exc)

        self.gathered.__enter__, self.gathered.__exit__ = entered, exited
        optimizer = self.engine.optimizer
        self.set_full = optimizer.set_full_hp_param  # what safe_set_full_fp32_param calls

        def set_full(value, param, *args, **kwargs):
            watch.fp32_set.add(id(param))
            return self.set_full(value, param, *args, **kwargs)

        optimizer.set_full_hp_param = set_full
        return self

    def __exit__(self, *exc):
        self.gathered.__enter__, self.gathered.__exit__ = self.enter, self.exit
        del self.engine.optimizer.set_full_hp_param  # the class's method again


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
    used = {id(u.param) for u in watch.seen.values() if u.phase != "constructor"}
    found = []
    for use in watch.seen.values():
        name = params.get(id(use.param))
        if use.phase == "constructor" and not _lost(watch, name, id(use.param) in used):
            continue
        reader = OUTSIDE if use.module is None else (modules.get(id(use.module)) or ROOT_NAME)
        parameter, fix, where = _describe(watch, use, name)
        found.append(Finding(parameter, reader, use.phase, use.step, fix, where))
    found += _built_findings(watch, {f.parameter for f in found if f.phase == "constructor"})
    for write in watch.lost_writes.values():
        name = params.get(id(write.param))
        if name is None:
            continue  # not a weight of the model's (the checker's own, say)
        reader = OUTSIDE if write.module is None else (
            modules.get(id(write.module)) or ROOT_NAME)
        fix, where = _write_fix(watch, write, name)
        found.append(Finding(name, reader, write.phase, write.step, fix, where, "write"))
    for phase, step, error in errors:
        found.append(Finding("(unknown)", OUTSIDE, phase, step, "",
                             f"the run raised {type(error).__name__}: {error}"))
    return found


def _built_findings(watch, reported):
    """Every weight of the model that ZeRO-3's build leaves other than plain PyTorch's,
    and no use above explains: an empty copy (copy.deepcopy of a partitioned module), a
    parameter made from a partitioned one (clone(), nn.Parameter(other.weight)), a copy
    of a weight whose change in a constructor was lost, or a value that differs."""
    zero3, plain = watch.as_zero3_builds_it, watch.as_plain_builds_it
    if watch.root is None or zero3 is None or plain is None:
        return []
    changed = {id(u.param): u for u in watch.seen.values()
               if u.phase == "constructor" and u.changed}
    found = []
    for name, param in watch.root.named_parameters():
        if name not in zero3 or name not in plain:
            continue
        got, want = zero3[name], plain[name]
        if got.shape == want.shape and torch.equal(got, want):
            continue
        empty = got.numel() == 0 < want.numel()
        made = watch.copies.get(id(param))
        if made is not None:
            if empty:
                found.append(Finding(name, OUTSIDE, "constructor", None,
                                     *_copy_fix(made), "copy"))
            lost = changed.get(id(made.original))
            if lost is not None:
                found.append(Finding(name, OUTSIDE, "constructor", None,
                                     *_copied_change_fix(made, lost), "changed"))
            elif not empty:
                found.append(_differs(name))
        elif name in reported:
            continue
        elif empty:
            found.append(Finding(name, OUTSIDE, "constructor", None,
                                 *_empty_fix(watch, param), "empty"))
        else:
            found.append(_differs(name))
    return found


def _in(owner):
    return f" in `{type(owner).__name__}.__init__`" if owner is not None else ""


def _copy_fix(made):
    what = type(made.copied).__name__
    if made.source is None:
        return "", (f"`copy.deepcopy` at `{made.site}` copied a partitioned `{what}`: its "
                    "copies hold nothing; gather what it copies around that line (the "
                    "checker found no name for it there)")
    block = (f"{made.source}.parameters()" if isinstance(made.copied, torch.nn.Module)
             else made.source)
    return (f"with deepspeed.zero.GatheredParameters({block}):",
            f"around `{made.site}`{_in(made.owner)}: empty copies of the partitioned `{what}` "
            f"`{made.source}` (made by `copy.deepcopy`; not ZeRO-3 parameters): copied inside "
            "the block, the copies get the whole weights, and `deepspeed.initialize` "
            "partitions them (or build each copy with its constructor instead)")


def _copied_change_fix(made, lost):
    target = _python_path(made.path, made.source or "?")
    fix = f"with deepspeed.zero.GatheredParameters({target}, modifier_rank=0):"
    if lost.library_line is not None and isinstance(made.copied, torch.nn.Module):
        holder = _python_path(_path_from(made.copied, lost.init_owner), made.source or "?")
        return fix, (f"before the copy at `{made.site}`, around what "
                     f"`{type(lost.init_owner).__name__}.__init__` did to it, done again "
                     f"({lost.library_line}, its `self` being `{holder}`): zero.Init had "
                     "partitioned it, so the change was lost, and the copies have the value "
                     "from before it")
    return fix, (f"around `{lost.site}`{_in(lost.user_owner)}: it changed `{target}` after "
                 "zero.Init had partitioned it, so the change was lost, and the copy at "
                 f"`{made.site}` has the value from before it")


def _empty_fix(watch, param):
    site, owner = watch.made_at.get(id(param), ("?", None))
    sources = []
    for used in watch.site_uses.get(site, []):
        path = _path_in(owner, used) if owner is not None else None
        if used is not param and path is not None:
            sources.append(_python_path(path))
    empty = "made from a partitioned parameter, it holds nothing (full shape (0,))"
    if not sources:
        return "", (f"made at `{site}`{_in(owner)}: {empty}; make it from the whole "
                    "parameter, in `deepspeed.zero.GatheredParameters(...)` around that line")
    block = sources[0] if len(sources) == 1 else f"[{', '.join(sources)}]"
    return (f"with deepspeed.zero.GatheredParameters({block}):",
            f"around `{site}`{_in(owner)}: {empty}; made inside the block from the whole "
            "parameter, it gets its values, and zero.Init partitions it")


def _differs(name):
    return Finding(name, OUTSIDE, "constructor", None, "",
                   "built under zero.Init, it starts from another value than in plain "
                   "PyTorch, and the checker saw nothing that changed it: compare your "
                   "initialisation with a plain build", "changed")


def _write_fix(watch, write, name):
    """The line that keeps a write ZeRO-3 would discard, and where it goes."""
    target = _python_path(name, "engine.module")
    block = f"with deepspeed.zero.GatheredParameters({target}, modifier_rank=0):"
    both = ("and give the new value to `deepspeed.utils.safe_set_full_fp32_param` too "
            "(the optimizer's copy wins at `engine.step()`)")
    if write.module is None and write.modifying:
        return (f"deepspeed.utils.safe_set_full_fp32_param({target}, new_value)",
                f"after the block around `{write.site}` (in your loop): the optimizer's copy "
                "wins at `engine.step()`, and undoes the change")
    if write.module is None:
        return block, (f"around `{write.site}` (in your loop), {both}: ZeRO-3 drops a "
                       "change to a weight it gathered")
    cls = type(write.module).__name__
    own = (f"; for `nn.Embedding(max_norm=...)`: set its `max_norm` to None and renormalise "
           "the rows of each batch there (`torch.embedding_renorm_`)"
           if isinstance(write.module, torch.nn.Embedding) and write.module.max_norm else "")
    return block, (f"in your loop, outside every forward: make there the change "
                   f"`{write.op}` makes in `{cls}.forward` (ZeRO-3 drops a change to a "
                   f"weight it gathered when it releases it), {both}{own}")


def _lost(watch, name, used_later):
    """Whether a use in the constructor changed what the model holds. Not when the weight
    is no longer in the model (tying replaced it) and nothing used it later; not when
    ZeRO-3's build gives the weight plain PyTorch's values (Transformers writing ones where
    they already are, say)."""
    if name is None:
        return used_later
    zero3, plain = watch.as_zero3_builds_it, watch.as_plain_builds_it
    if zero3 is None or plain is None or name not in zero3 or name not in plain:
        return True
    return not torch.equal(zero3[name], plain[name])


def _describe(watch, use, name):
    """The parameter's name as the user can write it, the line that fixes the use, and
    where the line goes."""
    root = watch.root
    held = None if name is not None else _outside_tree(watch, use.param)
    if held is not None:
        name, where_held = held[0], held[1]
        parameter = f"{name} (outside the model's module tree: {where_held})"
    elif name is None:  # not created while the model was built
        shape = tuple(use.param.ds_shape)
        return (f"a parameter of shape {shape} the model does not hold", "",
                "the checker knows nothing else of it: it was not created in `build()`")
    else:
        parameter = name
    if use.phase == "constructor":
        return (parameter, *_constructor_fix(root, use, name,
                                             watch.site_uses.get(use.site, ())))
    if use.module is None:
        weight = _python_path(name, "engine.module")
        block = f"with deepspeed.zero.GatheredParameters({weight}):"
        if use.phase == "backward":
            return parameter, block, (
                f"move `engine.backward(loss)` into the block around `{use.site}`: "
                "autograd reads it again in backward")
        if use.needs_grad:
            return parameter, block, (
                f"around `{use.site}` and `engine.backward(loss)` (in your loop): "
                "autograd reads it again in backward")
        return parameter, block, f"around `{use.site}` (in your loop)"
    if held is not None:
        return (parameter, *held[2:])
    holder, path = _common_holder(root, use.module, name)
    target = "self" if holder is use.module else _python_path(_path_from(holder, use.module))
    return (parameter,
            f"deepspeed.zero.register_external_parameter({target}, {_python_path(path)})",
            f"at the end of `{type(holder).__name__}.__init__`")


def _constructor_fix(root, use, name, used_there=()):
    if use.hf_init and _is_transformers_model(root):
        auto = _auto_class(type(root), root.config)
        return (f"model = transformers.{auto}.from_config(config)",
                f"instead of `{type(root).__name__}(config)` inside `deepspeed.zero.Init`, "
                "while an `HfDeepSpeedConfig` of your DeepSpeed config is alive: "
                "Transformers then initializes each weight gathered")
    owner = use.init_owner
    if use.library_line is not None and use.user_owner is not None:
        path = _path_in(use.user_owner, use.param)
        holder = _python_path(_path_from(use.user_owner, owner))
        if path is not None:
            return (f"with deepspeed.zero.GatheredParameters({_python_path(path)}, "
                    "modifier_rank=0):",
                    f"at the end of `{type(use.user_owner).__name__}.__init__`, around what "
                    f"`{type(owner).__name__}.__init__` did to it, done again "
                    f"({use.library_line}, its `self` being `{holder}`): zero.Init had "
                    "partitioned it, so the change was lost")
    path = _path_in(owner, use.param) if owner is not None else None
    target = _python_path(path) if path else "list(self.parameters())"
    if path and owner is not None:  # every partitioned parameter that line uses, in order
        paths = [_path_in(owner, p) for p in used_there]
        paths = [p for p in paths if p is not None]
        if len(paths) > 1 and path in paths:  # load_state_dict of one module into another
            target = f"[{', '.join(_python_path(p) for p in paths)}]"
    where = f"around `{use.site}`"
    if owner is not None:
        where += f" in `{type(owner).__name__}.__init__`"
    # modifier_rank=0 keeps a change (rank 0's values go to every rank); a read needs none,
    # but a view taken there (`weight[0]`) may be changed after the read.
    return f"with deepspeed.zero.GatheredParameters({target}, modifier_rank=0):", where


def _is_transformers_model(model):
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _auto_class(model_class, config):
    """The Auto class whose from_config builds `model_class` from this config."""
    import transformers

    for name in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                 "AutoModelForImageTextToText", "AutoModel"):
        mapping = getattr(transformers, name)._model_mapping
        if mapping.get(type(config), None) is model_class:
            return name
    return "AutoModel"


def _path_in(module, param):
    for name, p in module.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    return None


def _outside_tree(watch, param):
    """A parameter the model uses but does not hold in its module tree: (a path to it, a
    description, the fix, where it goes), or None when nothing is known of it."""
    if id(param) not in watch.created:
        return None
    _, module, site = watch.created[id(param)]
    own = next((n for n, p in module._parameters.items() if p is param), "?")
    where_held = f"held by {type(module).__name__} at {site}"
    for holder_name, holder in watch.root.named_modules():
        for attr, value in vars(holder).items():
            if attr.startswith("_"):
                continue
            prefix = f"{holder_name}.{attr}" if holder_name else attr
            cls = f"`{type(holder).__name__}.__init__`"
            frozen = ("it was never given to the optimizer, so it stays frozen; leave out "
                      "`.requires_grad_(False)` to train it")
            if value is module:
                return (f"{prefix}.{own}", where_held,
                        f'self.add_module("{attr}", self.__dict__.pop("{attr}")'
                        '.requires_grad_(False))',
                        f"at the end of {cls}: a submodule, it is gathered in its own "
                        f"forward; {frozen}")
            if isinstance(value, (list, tuple)) and any(v is module for v in value):
                index = next(i for i, v in enumerate(value) if v is module)
                return (f"{prefix}[{index}].{own}", where_held,
                        f"self.{attr} = torch.nn.ModuleList(self.{attr}).requires_grad_(False)",
                        f"at the end of {cls}: submodules are gathered in their forward; "
                        f"{frozen}")
            if isinstance(value, dict) and any(v is module for v in value.values()):
                key = next(k for k, v in value.items() if v is module)
                return (f"{prefix}[{key!r}].{own}", where_held,
                        f"self.{attr} = torch.nn.ModuleDict(self.{attr}).requires_grad_(False)",
                        f"at the end of {cls}: submodules are gathered in their forward; "
                        f"{frozen}")
    return (f"{type(module).__name__}.{own}", where_held,
            f"# make the {type(module).__name__} created at {site} a submodule",
            "no attribute of the model holds it: make it a submodule of the module that "
            "calls it, or build it outside `deepspeed.zero.Init`")


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
    """The findings, those with the same fix together: what was used, by which forward in
    which phase, then where the fix goes and the line itself."""
    if not findings:
        print("No findings: ZeRO-3 gathered every parameter this model read and lost no "
              "weight.", file=out)
        return
    uses = sum(_as_finding(f).kind == "use" for f in findings)
    lost = len({f.parameter for f in map(_as_finding, findings) if f.kind != "use"})
    counts = [f"{uses} use(s) of a parameter ZeRO-3 had not gathered" if uses else "",
              f"{lost} weight(s) ZeRO-3 left empty or lost" if lost else ""]
    print(", ".join(c for c in counts if c) + ":", file=out)
    groups = {}
    for f in map(_as_finding, findings):
        groups.setdefault((f.reader, f.phase, f.step, f.fix, f.where), []).append(f.parameter)
    for (reader, phase, step, fix, where), names in groups.items():
        names = _shorter(names)
        when = {OUTSIDE: f"{phase}, outside any forward", ROOT_NAME: f"{phase} of the model"
                }.get(reader, f"{phase} of {reader}")
        if phase == "constructor":
            when = phase
        if step is not None:
            when += f", step {step}"
        print(textwrap.fill(", ".join(names), 92, subsequent_indent="  "), file=out)
        print(f"  when: {when}", file=out)
        print(f"  fix, {where}:" if fix else f"  {where}", file=out)
        if fix:
            print(f"    {fix}", file=out)


def _shorter(names):
    """More than 12 names: those under one module, the first path component after the
    prefix they all share, as "layers.0.* (12 parameters)"."""
    if len(names) <= 12:
        return names
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    groups = {}
    for name, p in zip(names, parts):
        groups.setdefault(".".join(p[:common + 1]), []).append(name)
    return [g[0] if len(g) == 1 else f"{key}.* ({len(g)} parameters)"
            for key, g in groups.items()]


def apply_fixes(model, findings):
    """Run the fix lines that go at the end of an `__init__` on every module of that class
    in the built `model`, as if each line were there (a way to try them before you edit
    your code; the checker's tests apply them so). Returns how many lines ran."""
    ran = 0
    lines = {(f.fix, f.where): None for f in map(_as_finding, findings)}  # each line once
    for fix, where in lines:
        cls = re.match(r"at the end of `(\w+)\.__init__`", where)
        if fix.endswith(":"):  # a block, around a line the finding names: yours to write
            continue
        for module in list(model.modules()) if cls else ():
            if type(module).__name__ == cls[1]:
                exec(fix, {"deepspeed": deepspeed, "torch": torch, "self": module})
                ran += 1
    return ran


@contextlib.contextmanager
def loop_fixes(findings, engine):
    """The `GatheredParameters` blocks the fixes put in the training loop, entered
    together: put the lines they name, and `engine.backward(loss)`, inside."""
    lines = {f.fix for f in map(_as_finding, findings)
             if f.reader == OUTSIDE and f.phase != "constructor" and f.fix.startswith("with ")}
    with contextlib.ExitStack() as stack:
        for line in sorted(lines):
            names = {"deepspeed": deepspeed, "engine": engine}
            stack.enter_context(eval(line.removeprefix("with ").removesuffix(":"), names))
        yield


def _as_finding(finding):
    return Finding(**finding) if isinstance(finding, dict) else finding


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
