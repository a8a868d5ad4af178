"""One rank process of a snippet run: started by `rankrun/runner.py`, never imported by tests.

    python rankrun/rank_main.py SNIPPET REPORT_FILE [FUNCTION]   # run one snippet, exit
    python rankrun/rank_main.py --zygote CONTROL_FD              # forks warm workers

One-shot: runs SNIPPET as `__main__` (exactly as `python SNIPPET` would). With
FUNCTION, keeps what that function returned: when the file's main block is just
`FUNCTION()`, it still runs as `__main__` (rankrun.entry), so the run is the same
as without FUNCTION; otherwise it loads the file as a module and calls FUNCTION.
Writes a pickled report (exception details, the function's return value) to
REPORT_FILE and exits 0 on success, 1 when the snippet raised.

Warm worker (forked by the zygote, which imported torch and DeepSpeed once for the
whole test session): reads one JSON job on its job pipe ({"snippet", "report",
"function", "stdout", "stderr", "env"}), runs it like the one-shot mode with its
stdout/stderr (file descriptors 1 and 2, so C-level output and DeepSpeed's logger
too) sent to the job's files, answers `{"exit_code": N}` on its reply pipe, and
ends: one job per worker.

Every rank, one-shot or warm, is a child subreaper, kills what the snippet left
running (and reports it), and dumps its threads' stacks on SIGUSR1.
"""

import json
import os
import pickle
import random
import runpy
import sys
import traceback
import types
import warnings

from rankrun.entry import RETURNED, main_code_keeping
from rankrun.lifetime import become_subreaper, die_with_parent, end_with_descendants, left_running


def describe(error: BaseException) -> dict:
    kind = type(error)
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "name": kind.__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
    }


# Set when the snippet ended the way the examples end (os._exit after main(), see
# docs/versions.md, "An abort at exit"): a fresh rank then ends without Python's shutdown too.
ENDED_WITHOUT_SHUTDOWN = False


class OsExit(SystemExit):
    """The snippet called os._exit(code): it ends with that code, without an exception."""


def os_exit_as_system_exit(rank_pid: int):
    """What os._exit is while a snippet runs: OsExit(code), so that the rank still writes its
    report (and a pool worker answers) before it ends; the real os._exit in a child the
    snippet forked."""
    real_exit = os._exit

    def _exit(code):
        global ENDED_WITHOUT_SHUTDOWN
        if os.getpid() != rank_pid:
            real_exit(code)
        ENDED_WITHOUT_SHUTDOWN = True
        raise OsExit(code)

    return real_exit, _exit


def run_one(snippet: str, report_file: str, function: str = "") -> int:
    """Run one snippet in this process; write its report; return the exit code."""
    # Look like `python SNIPPET`: argv and the import path start at the snippet.
    sys.argv = [snippet]
    sys.path[0] = os.path.dirname(os.path.abspath(snippet))
    report = {"exception": None, "returned": None}
    exit_code = 0
    rank_pid = os.getpid()
    real_exit, os._exit = os_exit_as_system_exit(rank_pid)
    try:
        as_main = main_code_keeping(snippet, function) if function else None
        if as_main is not None:
            report["returned"] = run_as_main(as_main, snippet)
        elif function:
            namespace = runpy.run_path(snippet, run_name="__snippet__")
            report["returned"] = namespace[function]()
        else:
            runpy.run_path(snippet, run_name="__main__")
    except OsExit as ended:  # like the real os._exit: its code, no exception, no traceback
        exit_code = ended.code
    except SystemExit as stop:
        if stop.code not in (None, 0):
            report["exception"] = describe(stop)
            exit_code = stop.code if isinstance(stop.code, int) else 1
    except BaseException as error:  # noqa: BLE001 - the report is the point
        report["exception"] = describe(error)
        traceback.print_exc()
        exit_code = 1
    finally:
        os._exit = real_exit
        sys.stdout.flush()
        sys.stderr.flush()
        if os.getpid() != rank_pid:
            # A child the snippet forked (os.fork) that did not call os._exit came back
            # here. Under `python snippet.py` it would just end: end it, before it can
            # write the rank's report or answer for the pool worker.
            os._exit(exit_code)
        report["left_running"] = left_running()
        try:
            payload = pickle.dumps(report)
        except Exception as error:  # an unpicklable return value is a failure too
            report = {"exception": describe(error), "returned": None, "left_running": report["left_running"]}
            payload = pickle.dumps(report)
            exit_code = exit_code or 1
        with open(report_file, "wb") as handle:
            handle.write(payload)
    return exit_code


def run_as_main(code, snippet: str):
    """Run `code` (the snippet, see rankrun.entry) as the `__main__` module, as runpy.run_path
    does, and return what its main block's call returned."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=snippet, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    previous = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    except SystemExit as stop:
        # main() returned, then the main block ended the process (os._exit(0), as the
        # examples end): the run succeeded and main's value is kept.
        if stop.code not in (None, 0) or RETURNED not in module.__dict__:
            raise
    finally:
        if previous is not None:
            sys.modules["__main__"] = previous
    return module.__dict__.get(RETURNED)


PROJECT = os.getcwd()  # the runner starts every rank and the zygote in the project's root


def as_a_new_process() -> None:
    """What a forked worker changes to start like `python SNIPPET` would, not like a copy of the
    zygote: the warning filters of a fresh process, and random states seeded from the OS (a
    fork inherits the zygote's, so every worker would draw the same numbers)."""
    import torch

    if FILTERS_OF_A_FRESH_PROCESS is not None:
        warnings.filters[:] = FILTERS_OF_A_FRESH_PROCESS
    random.seed()
    torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def probe_stacks_on_request(path: str) -> None:
    """On SIGUSR2, append every thread's Python stack to `path`: the runner's hang watcher
    (rankrun/hang.py) looks at a rank this way while it runs, without touching its stderr.
    The file appears under its name only once the handler is in place (an early SIGUSR2 would
    end the process), so the watcher asks only a rank whose file exists."""
    import faulthandler
    import signal

    global _STACKS_FD
    partial = path + ".partial"
    _STACKS_FD = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    faulthandler.register(signal.SIGUSR2, file=_STACKS_FD, all_threads=True)
    os.rename(partial, path)


_STACKS_FD = None


def dump_stacks_on_request() -> None:
    """On SIGUSR1, write every thread's Python stack to stderr (file descriptor 2), even while
    the rank is blocked in C code (a collective): the runner asks before it kills a hung rank."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


# Imported once by a pool worker, before its first job. Only speed depends on this
# list: torch and DeepSpeed import these lazily on first use (deepspeed.initialize
# imports torch._dynamo and inductor through its optimizer check, ~3 s of CPU), and
# a fresh process would import them just the same.
# The Transformers page's examples: importing Trainer and T5 takes 10-20 s per process, once
# here instead of in every rank of every run. A session that runs none of those examples (a
# `--changed` run for a ZeRO-3 page, say) leaves them out (rankrun.plugin): 3 s of CPU here.
TRANSFORMERS_IMPORTS = ["accelerate", "transformers.trainer", "transformers.models.t5.modeling_t5"]
WARM_IMPORTS = [
    "torch", "deepspeed", "deepspeed.pipe", "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.muon.muon_optimizer", "torch._dynamo", "torch._inductor.compile_fx",
    "torch.distributed.pipelining", "torch.distributed.fsdp",
    *TRANSFORMERS_IMPORTS,
]
# What a warm rank has imported is not only a matter of speed: an example whose outcome depends
# on a first import (a model class first imported inside deepspeed.zero.Init fails because that
# first imports torch._dynamo) must run with fresh=True, in a new interpreter as torchrun starts it.


# The warning filters right after `import torch, deepspeed`: some lazily imported
# modules add one (sympy: "once" for SymPyDeprecationWarning); a fresh process
# starts without it, so every job does too.
FILTERS_OF_A_FRESH_PROCESS = None


def warm_imports() -> list[str]:
    """WARM_IMPORTS, or the modules named in RANKRUN_WARM_IMPORTS (comma-separated): the
    harness's own tests start whole test sessions whose cases need torch only, and importing
    Transformers and DeepSpeed there would be most of their time."""
    chosen = os.environ.get("RANKRUN_WARM_IMPORTS")
    return [name.strip() for name in chosen.split(",") if name.strip()] if chosen else WARM_IMPORTS


def warm_up() -> None:
    global FILTERS_OF_A_FRESH_PROCESS
    import importlib

    modules = warm_imports()
    import torch  # noqa: F401

    if "deepspeed" in modules:
        import deepspeed  # noqa: F401
    # What `python snippet.py` has after its first imports (see FILTERS_OF_A_FRESH_PROCESS).
    FILTERS_OF_A_FRESH_PROCESS = list(warnings.filters)
    for name in modules:
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


def serve(jobs_fd: int, reply_fd: int) -> int:
    """A warm pool worker: wait for one JSON job on `jobs_fd`, run it, answer on `reply_fd`, end.

    One job per worker: the next run gets a new worker forked from the zygote, so nothing a
    snippet changes in its process (modules, globals, threads, signal handlers, limits, open
    files, ...) can reach another snippet, and nothing has to be put back.
    """
    as_a_new_process()
    become_subreaper()
    dump_stacks_on_request()
    with os.fdopen(jobs_fd, "r") as jobs, os.fdopen(reply_fd, "w") as replies:
        replies.write(json.dumps({"ready": os.getpid()}) + "\n")
        replies.flush()
        line = jobs.readline()
        if not line:  # the runner closed the pipe: a spare worker that was never used
            return 0
        job = json.loads(line)
        if job.get("stacks"):
            probe_stacks_on_request(job["stacks"])
        os.environ.update(job["env"])
        out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        exit_code = measured_run(job["snippet"], job["report"], job.get("function") or "")
        replies.write(json.dumps({"exit_code": exit_code}) + "\n")
        replies.flush()
    return 0  # the job's exit code went in the answer


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
    import signal
    import socket

    # When the runner's process ends, even by SIGKILL, this process gets SIGTERM and kills every
    # process below it first: the workers, and what their snippets started (the workers are
    # subreapers, so that is all below them too).
    import psutil  # noqa: F401 - imported now: end_with_descendants may run at any moment

    signal.signal(signal.SIGTERM, lambda signum, frame: end_with_descendants())
    die_with_parent(signal.SIGTERM)
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
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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


def measured_run(snippet: str, report_file: str, function: str = "") -> int:
    """run_one, under coverage when the runner asks this rank for it (rankrun.snippet_coverage:
    SNIPPET_COVERAGE_RANKS in the job's environment); the lines it ran are written for the gate."""
    from rankrun import snippet_coverage

    if not snippet_coverage.traced_here():
        return run_one(snippet, report_file, function)
    import coverage

    measured = coverage.Coverage(data_file=None, config_file=False,
                                 include=[os.path.join(PROJECT, "snippets", "*")])
    measured.start()
    try:
        return run_one(snippet, report_file, function)
    finally:
        measured.stop()
        # Before the rank answers: after a failure the pool is killed.
        snippet_coverage.record_seen(snippet_coverage.lines_of(measured))


def main() -> int:
    if sys.argv[1] == "--zygote":
        return zygote(int(sys.argv[2]))
    die_with_parent()  # a fresh rank ends with the test process, even if that is killed outright
    become_subreaper()
    dump_stacks_on_request()
    stacks = os.environ.pop("RANKRUN_STACKS_FILE", "")  # rankrun.launch.STACKS_VARIABLE
    if stacks:
        probe_stacks_on_request(stacks)
    snippet, report_file = sys.argv[1], sys.argv[2]
    function = sys.argv[3] if len(sys.argv) > 3 else ""
    code = measured_run(snippet, report_file, function)
    if ENDED_WITHOUT_SHUTDOWN:
        # As the snippet does under torchrun: no interpreter shutdown for gloo's threads to abort.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
