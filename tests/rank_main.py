"""One rank process of a snippet run: started by `tests/runner.py`, never imported by tests.

    python tests/rank_main.py SNIPPET REPORT_FILE [FUNCTION]   # run one snippet, exit
    python tests/rank_main.py --zygote CONTROL_FD              # forks warm pool workers

One-shot: runs SNIPPET as `__main__` (exactly as `python SNIPPET` would), or,
with FUNCTION, loads it as a module and calls that function with no arguments.
Writes a pickled report (exception details, the function's return value) to
REPORT_FILE and exits 0 on success, 1 when the snippet raised.

Warm pool worker (forked by the zygote, which imported torch and DeepSpeed
once for the whole test session): reads one JSON job per line on its job pipe
({"snippet", "report", "function", "stdout", "stderr", "env"}),
runs it like the one-shot mode with its stdout/stderr (file descriptors 1 and 2,
so C-level output and DeepSpeed's logger too) sent to the job's files, puts
back the state a fresh process would have, and answers `{"exit_code": N}` on
REPLY_FD.
"""

import json
import os
import pickle
import random
import runpy
import sys
import traceback
import warnings


def describe(error: BaseException) -> dict:
    kind = type(error)
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "name": kind.__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
    }


def run_one(snippet: str, report_file: str, function: str = "") -> int:
    """Run one snippet in this process; write its report; return the exit code."""
    # Look like `python SNIPPET`: argv and the import path start at the snippet.
    sys.argv = [snippet]
    sys.path[0] = os.path.dirname(os.path.abspath(snippet))
    report = {"exception": None, "returned": None}
    exit_code = 0
    rank_pid = os.getpid()
    try:
        if function:
            namespace = runpy.run_path(snippet, run_name="__snippet__")
            report["returned"] = namespace[function]()
        else:
            runpy.run_path(snippet, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            report["exception"] = describe(stop)
            exit_code = stop.code if isinstance(stop.code, int) else 1
    except BaseException as error:  # noqa: BLE001 - the report is the point
        report["exception"] = describe(error)
        traceback.print_exc()
        exit_code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if os.getpid() != rank_pid:
            # A child the snippet forked (os.fork) that did not call os._exit came back
            # here. Under `python snippet.py` it would just end: end it, before it can
            # write the rank's report or answer for the pool worker.
            os._exit(exit_code)
        try:
            payload = pickle.dumps(report)
        except Exception as error:  # an unpicklable return value is a failure too
            report = {"exception": describe(error), "returned": None}
            payload = pickle.dumps(report)
            exit_code = exit_code or 1
        with open(report_file, "wb") as handle:
            handle.write(payload)
    return exit_code


def shallow_copy(value):
    """A copy of a plain container's contents, to put back after a job mutated it in place."""
    return type(value)(value) if type(value) in (dict, list, set) else None


PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def from_project(module) -> bool:
    path = os.path.abspath(getattr(module, "__file__", None) or "/")
    return path.startswith(PROJECT + os.sep) and os.sep + ".venv" + os.sep not in path[len(PROJECT):]


class FreshState:
    """What a new rank process looks like before it runs a snippet, captured once and put back after each job.

    Covers what a snippet can change and the next one could see: environment
    variables, working directory, argv and import path, modules imported from
    the project, RNG states, torch's global switches, warning filters, and the
    process groups (a snippet that leaves them initialized gets them destroyed).
    """

    def __init__(self):
        import torch

        self.torch = torch
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.modules = set(sys.modules)
        self.random = random.getstate()
        self.torch_rng = torch.get_rng_state()
        self.default_dtype = torch.get_default_dtype()
        self.grad_enabled = torch.is_grad_enabled()
        self.num_threads = torch.get_num_threads()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.warnings = list(warnings.filters if FILTERS_OF_A_FRESH_PROCESS is None else FILTERS_OF_A_FRESH_PROCESS)
        # DeepSpeed keeps process groups, its comm backend and ZeRO bookkeeping in
        # module globals (deepspeed.comm.comm.cdb, deepspeed.utils.groups._WORLD_GROUP, ...).
        # Remember them as they are right after `import deepspeed`.
        self.deepspeed_globals = {
            name: {key: (value, shallow_copy(value)) for key, value in vars(module).items() if not key.startswith("__")}
            for name, module in list(sys.modules.items())
            if name.split(".")[0] == "deepspeed" and module is not None
        }

    def restore_deepspeed_globals(self):
        for name, saved in self.deepspeed_globals.items():
            namespace = vars(sys.modules[name])
            for key in [key for key in namespace if key not in saved and not key.startswith("__")]:
                del namespace[key]
            for key, (value, contents) in saved.items():
                namespace[key] = value
                if contents is None:
                    continue
                # Put the contents back without comparing: __eq__ of what they hold can be costly.
                value.clear()
                if type(value) is list:
                    value.extend(contents)
                else:
                    value.update(contents)

    def restore(self):
        torch = self.torch
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.restore_deepspeed_globals()
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        for name in set(sys.modules) - self.modules:
            # Modules the snippet imported from the project (its siblings,
            # helpers) must be imported afresh by the next snippet.
            if from_project(sys.modules.get(name)):
                del sys.modules[name]
        random.setstate(self.random)
        torch.set_rng_state(self.torch_rng)
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_num_threads(self.num_threads)
        if torch.are_deterministic_algorithms_enabled() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic)  # costly: imports torch._inductor
        warnings.filters[:] = self.warnings


# Imported once by a pool worker, before its first job. Only speed depends on this
# list: torch and DeepSpeed import these lazily on first use (deepspeed.initialize
# imports torch._dynamo and inductor through its optimizer check, ~3 s of CPU), and
# a fresh process would import them just the same.
WARM_IMPORTS = [
    "torch", "deepspeed", "deepspeed.pipe", "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.muon.muon_optimizer", "torch._dynamo", "torch._inductor.compile_fx",
    "torch.distributed.pipelining", "torch.distributed.fsdp",
    # The Transformers page's examples: importing Trainer and T5 takes 10-20 s per process,
    # once here instead of in every rank of every run.
    "accelerate", "transformers.trainer", "transformers.models.t5.modeling_t5",
]


# The warning filters right after `import torch, deepspeed`: some lazily imported
# modules add one (sympy: "once" for SymPyDeprecationWarning); a fresh process
# starts without it, so every job does too.
FILTERS_OF_A_FRESH_PROCESS = None


def warm_up() -> None:
    global FILTERS_OF_A_FRESH_PROCESS
    import importlib

    import deepspeed  # noqa: F401
    import torch  # noqa: F401

    FILTERS_OF_A_FRESH_PROCESS = list(warnings.filters)
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    settle_heap()


def settle_heap() -> None:
    """Collect garbage, then exempt what survives from later collections (gc.freeze).

    DeepSpeed calls gc.collect() in every ZeRO-3 initialize; a full collection walks every
    object torch and DeepSpeed created at import time (~0.27 s a call here). Frozen objects
    are still alive and usable; they are only never scanned again.
    """
    import gc

    gc.collect()
    gc.freeze()


def die_with_parent() -> None:
    """Get SIGKILL when the parent process ends, even if it is killed with no chance to clean up."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve(jobs_fd: int, reply_fd: int) -> int:
    """The warm pool worker's loop: one JSON job per line on `jobs_fd`, one answer per job on `reply_fd`."""
    measured = snippet_coverage()
    fresh = FreshState()
    warnings.filters[:] = fresh.warnings
    saved_stdout, saved_stderr = os.dup(1), os.dup(2)
    with os.fdopen(jobs_fd, "r") as jobs, os.fdopen(reply_fd, "w") as replies:
        replies.write(json.dumps({"ready": os.getpid()}) + "\n")
        replies.flush()
        for line in jobs:
            job = json.loads(line)
            os.environ.update(job["env"])
            out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            err = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.close(out)
            os.close(err)
            exit_code = measured_run(measured, job["snippet"], job["report"], job.get("function") or "")
            # Answer first: a failed rank must be seen before its peers fail
            # because it went away. After a failure the pool is killed anyway.
            replies.write(json.dumps({"exit_code": exit_code}) + "\n")
            replies.flush()
            try:
                fresh.restore()
                settle_heap()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved_stdout, 1)
                os.dup2(saved_stderr, 2)
    return 0


def zygote(control_fd: int) -> int:
    """Import torch and DeepSpeed once, then fork a warm pool worker per request.

    Requests come on the SOCK_SEQPACKET socket `control_fd`: a JSON packet
    {"env": {...}} carrying three file descriptors (the worker's job pipe, its
    reply pipe, its log). The forked worker gets its own session (so the runner
    can kill it with everything it starts), dies with this process, and runs
    `serve`. This process answers {"started": PID} per request and
    {"exited": PID, "code": C} (C negative: killed by that signal) when a worker
    ends, so the runner sees exit codes as if the worker were its own child.
    Starting a pool this way costs a fork, not a new interpreter's imports.
    """
    import select
    import socket

    die_with_parent()
    warm_up()
    control = socket.socket(fileno=control_fd)
    running: set[int] = set()
    while True:
        ready, _, _ = select.select([control], [], [], 0.02)
        if ready:
            message, fds, _, _ = socket.recv_fds(control, 65536, 3)
            if not message:  # the runner closed its end: the session is over
                break
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    control.close()
                    os.setsid()
                    die_with_parent()
                    jobs_fd, reply_fd, log_fd = fds
                    os.dup2(log_fd, 2)
                    os.close(log_fd)
                    devnull = os.open(os.devnull, os.O_RDWR)
                    os.dup2(devnull, 0)
                    os.dup2(devnull, 1)
                    os.close(devnull)
                    os.environ.update(request["env"])
                    code = serve(jobs_fd, reply_fd)
                except BaseException:  # noqa: BLE001 - report, then never return into the zygote's loop
                    traceback.print_exc()
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            running.add(pid)
            control.send(json.dumps({"started": pid}).encode())
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                control.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
    return 0


def snippet_coverage():
    """Line coverage of snippets/ in this rank, when the test session asks for it (tests/coverage_gate.py).

    Returns a Coverage object, not yet started, or None.
    """
    data_file = os.environ.get("SNIPPET_COVERAGE_DATA")
    if not data_file:
        return None
    import coverage

    return coverage.Coverage(
        data_file=data_file, data_suffix=True, config_file=False,
        include=[os.path.join(PROJECT, "snippets", "*")],
    )


def measured_run(measured, snippet: str, report_file: str, function: str = "") -> int:
    """run_one, under coverage when the runner asks for it (SNIPPET_COVERAGE_THIS_RUN=1 in the job's environment)."""
    if measured is None or os.environ.get("SNIPPET_COVERAGE_THIS_RUN") != "1":
        return run_one(snippet, report_file, function)
    measured.start()
    try:
        return run_one(snippet, report_file, function)
    finally:
        measured.stop()
        measured.save()  # before the rank answers: after a failure the pool is killed


def main() -> int:
    if sys.argv[1] == "--zygote":
        return zygote(int(sys.argv[2]))
    snippet, report_file = sys.argv[1], sys.argv[2]
    function = sys.argv[3] if len(sys.argv) > 3 else ""
    return measured_run(snippet_coverage(), snippet, report_file, function)


if __name__ == "__main__":
    sys.exit(main())
