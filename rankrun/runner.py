"""Run one snippet file on N local ranks, the way `torchrun` would, and report.

    result = run_snippet("snippets/zero3/language_model.py", world_size=2)
    result.check()              # raises SnippetFailed naming the snippet and rank
    result.output               # what the ranks printed, rank by rank
    result.ranks[1].exception   # {"type", "name", "message", "traceback"} or None

Every rank sees the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus DS_ACCELERATOR=cpu, so the
snippet's own `deepspeed.init_distributed(dist_backend="gloo")` works unchanged.

By default each rank is a process forked for this run from a warm zygote that
imported torch and DeepSpeed once (rankrun/rank_main.py): it starts warm, runs
this one snippet and ends, so no state passes from one snippet to the next.
`fresh=True` starts new interpreters instead, exactly like torchrun.

Each rank is a child subreaper: what a snippet starts and leaves running (also in
a new session, also orphaned) is killed, and the run fails with
"left a process running: PID CMD". A rank the runner has to kill (hung, or still
running after a peer failed) is first asked for its Python stack, which the
failure report shows.

Fail fast: once a rank has failed, the others get `grace` seconds to finish or
fail on their own, then they are killed (they are usually blocked in a
collective and gloo would wait 30 minutes). A whole run is bounded by
`timeout`. A failed or timed-out run kills every process it used, and their
children, before `run_snippet` returns; the next run starts a new pool.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rankrun import run_cache, snippet_coverage, torchrun_coverage
from rankrun.entry import guarded_function
from rankrun.launch import resolve_snippet, run_fresh, torchrun_environment
from rankrun.pool import (RankPool, close_pools, close_zygotes, fork_a_spare, pool_for_a_run, process_exists,
                          zygote_pids)
from rankrun.pages import RUN_BY_TORCHRUN, RUN_FRESH, documented_world_size, runs_before
from rankrun.project import ROOT, SNIPPETS, find_project_root, free_port
from rankrun.results import DEEPSPEED_NOISE, RankResult, RunResult, SnippetFailed, printed_by_the_example

# run_snippet on top of the layers below it (project, results, launch, pool, run_cache), and the
# names tests and hooks use from them.
__all__ = ["check_torchrun", "documented_run", "run_torchrun", "torchrun_result", "DEEPSPEED_NOISE", "ROOT", "SNIPPETS", "RankPool", "RankResult", "RunResult", "SnippetFailed",
           "close_pools", "close_zygotes", "find_project_root", "free_port", "printed_by_the_example",
           "process_exists", "resolve_snippet", "run_fresh", "run_snippet", "torchrun_environment", "zygote_pids"]


# Snippet line coverage (rankrun/coverage_gate.py) is measured only in the runs that can still add a
# line (rankrun.snippet_coverage).


def _coverage_wanted(path: Path) -> bool:
    return bool(os.environ.get("SNIPPET_COVERAGE_DATA")) and path.is_relative_to(SNIPPETS)


def run_snippet(
    snippet: str | os.PathLike,
    world_size: int = 2,
    *,
    call: str | None = None,
    timeout: float = 120.0,
    grace: float = 3.0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
    hang=None,
) -> RunResult:
    """Run `snippet` on `world_size` local ranks; see the module docstring.

    call: the name of a function in the snippet whose return value (picklable) comes back in
    `RankResult.returned`. When the file's main block is just `call()` (the convention for
    examples), the file still runs as `__main__`: a run with call="main" and one without are
    the same run, and both return what main() returned.
    fresh: start new processes for this run instead of using the warm pool.
    env: extra environment variables for the ranks.
    hang: a rankrun.hang.HangWatch: declare a hang of ranks waiting for each other as soon as the
    evidence is complete (result.hung) instead of waiting for `timeout`.

    In a test session, an example under snippets/ runs once per distinct (snippet, world size,
    entry point, env, fresh): later calls get the same RunResult (rankrun.run_cache).
    """
    path = resolve_snippet(snippet)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    call = call or guarded_function(path)
    shown = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return run_cache.get_or_run(
        run_cache.run_key(shown, world_size, call, env, fresh, hang=None if hang is None else hang.key()),
        lambda: _run_now(path, world_size, call, timeout, grace, env, fresh, hang),
        timeout, cacheable=path.is_relative_to(SNIPPETS),
        timed_out=lambda result: result.timed_out,
        rank_seconds=lambda result: result.seconds * result.world_size,
        outcome=lambda result: ("timed out" if result.timed_out else "hung" if result.hung
                                else "ok" if result.ok else "failed"),
    )


def _run_now(path: Path, world_size: int, call, timeout: float, grace: float, env, fresh: bool, hang=None) -> RunResult:
    """Make the run; its ranks measure snippet coverage when rankrun.snippet_coverage says so."""
    measured = _coverage_wanted(path)
    trace = snippet_coverage.ranks_to_trace(path, world_size) if measured else ""
    if trace:
        env = {**(env or {}), snippet_coverage.RANKS: trace}
    first_attempt = None
    for _ in range(2):
        if fresh:
            result = run_fresh(path, world_size, call, timeout, grace, env, hang)
        else:
            # The next run's ranks are forked while this one runs: a fork costs ~0.06 s per rank.
            result = pool_for_a_run(world_size).run(path, call, timeout, grace, env,
                                                    while_it_runs=lambda: fork_a_spare(world_size), hang=hang)
            fork_a_spare(world_size)  # if the run ended before its ranks all had the job
        if first_attempt is not None:
            result.retried_because = first_attempt.failure_report()
        if result.ok or not result.port_was_taken or first_attempt is not None:
            break
        # The port was free when the runner chose it, and something took it before
        # rank 0 could listen (another test run, say). The choice was the runner's,
        # so it tries once more with another port.
        first_attempt = result
    if measured:
        snippet_coverage.log_decision(path, world_size, trace, "fresh" if fresh else "warm")
    return result


# C++ stacks of a rank that gets a fatal signal at exit (see the sitecustomize.py there).
STACKS_AT_ABORT = Path(__file__).resolve().parent / "stacks_at_abort"
# The first line of c10's report of one thread: `SIGABRT(6), PID: 123, Thread 456: `.
SIGNAL_REPORT = re.compile(r"^\w+\(\d+\), PID: \d+, Thread \d+:")


def run_torchrun(snippet: str, nproc: int = 2, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """The documented command `torchrun --nproc_per_node N SNIPPET`, run for real as a reader
    would (torchrun next to this interpreter, DS_ACCELERATOR=cpu, no OMP_NUM_THREADS of ours),
    once per test session however many tests look at it (rankrun.run_cache). A rank that gets
    a fatal signal as it exits prints its C++ stacks (STACKS_AT_ABORT), for check_torchrun. For
    an example whose documented run it is (rankrun.pages.RUN_BY_TORCHRUN), the snippet's line
    coverage is measured in its ranks when the session measures it (rankrun.torchrun_coverage)."""
    def run() -> subprocess.CompletedProcess:
        env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
        env.update(DS_ACCELERATOR="cpu", PET_MASTER_PORT=str(free_port()),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(STACKS_AT_ABORT), env.get("PYTHONPATH")])))
        if snippet in RUN_BY_TORCHRUN and _coverage_wanted(ROOT / snippet):
            trace = snippet_coverage.ranks_to_trace(ROOT / snippet, nproc)
            snippet_coverage.log_decision(ROOT / snippet, nproc, trace, "torchrun")
            if trace:
                env.update(torchrun_coverage.environment(env))
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(nproc), snippet]
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        done.seconds = time.monotonic() - started
        return done

    return run_cache.get_or_run(run_cache.run_key(snippet, nproc, None, None, True, kind="torchrun"), run, timeout,
                                rank_seconds=lambda done: getattr(done, "seconds", 0.0) * nproc,
                                outcome=lambda done: "ok" if done.returncode == 0 else "failed")


def aborted_thread(stderr: str) -> str:
    """c10's report of the thread a fatal signal hit first in a torchrun run's stderr (the one
    in std::terminate or abort, when one is), or ''."""
    reports: list[list[str]] = []
    for line in stderr.splitlines():
        if SIGNAL_REPORT.match(line):
            reports.append([line.rstrip()])
        elif reports and reports[-1][-1] and line.strip():
            reports[-1].append(line.rstrip())
        elif reports:
            reports[-1].append("")  # a blank line ends a report
    reports = ["\n".join(report).strip() for report in reports]
    aborting = [report for report in reports if "std::terminate" in report or "abort" in report]
    return (aborting or reports or [""])[0]


def check_torchrun(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Raise unless the torchrun run succeeded. A rank killed by a signal (an abort at exit:
    `terminate called without an active exception`) is a failure like any other; the message
    shows the stack c10 printed for the thread it hit."""
    if done.returncode != 0:
        stack = aborted_thread(done.stderr)
        command = " ".join(["torchrun", *done.args[1:]])
        raise AssertionError(
            f"`{command}` exited with {done.returncode}"
            + (f"; a rank got a fatal signal, this thread first:\n{stack}\n" if stack else "\n")
            + f"--- the end of its stderr ---\n{done.stderr[-3000:]}")
    return done


# What torchrun puts before each line a rank wrote to stderr.
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
EXCEPTION_LINE = re.compile(r"^((?:\w+\.)*(\w+)): (.*)$")


def torchrun_exception(stderr: str) -> dict | None:
    """The last exception of rank 0's last traceback on torchrun's stderr (its lines carry
    torchrun's `[rank0]:`; torchrun's own ChildFailedError traceback does not)."""
    lines = [RANK_PREFIX.sub("", line) for line in stderr.splitlines() if RANK_PREFIX.match(line)]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1:]:
        match = EXCEPTION_LINE.match(line) if line and not line[0].isspace() else None
        if match:
            kind, name, message = match.groups()
            return {"type": kind, "name": name, "message": message, "traceback": "\n".join(lines[starts[-1]:])}
    return None


def torchrun_result(snippet: str, done: subprocess.CompletedProcess) -> RunResult:
    """A one-rank torchrun run as a RunResult (what tests and output files read): rank 0's
    stdout and stderr are torchrun's, its exception the last one its traceback names.
    One rank only: torchrun interleaves the stdout of several ranks."""
    exception = torchrun_exception(done.stderr) if done.returncode != 0 else None
    rank = RankResult(rank=0, pid=0, exit_code=done.returncode, stdout=done.stdout, stderr=done.stderr,
                      exception=exception)
    return RunResult(snippet=ROOT / snippet, world_size=1, ranks=[rank], seconds=getattr(done, "seconds", 0.0),
                     failed_first=[] if done.returncode == 0 else [0])


def documented_run(snippet: str | os.PathLike, timeout: float = 120.0) -> RunResult:
    """The snippet's run at its documented rank count, as every test that reads it shares it (made
    once per test session): in the warm pool; in fresh processes for an example whose outcome
    depends on what the process imported first (RUN_FRESH); through the documented torchrun
    command itself where that is the run (RUN_BY_TORCHRUN). An example that reads what another
    wrote (a checkpoint) says so in its docstring; that run comes first (its files stay in the
    session's TMPDIR)."""
    snippet = str(snippet)
    for other, ranks in runs_before(Path(snippet)):
        run_snippet(other, world_size=ranks, timeout=max(timeout, 120.0)).check()
    world_size = documented_world_size(Path(snippet))
    if snippet in RUN_BY_TORCHRUN:
        if world_size != 1:
            raise ValueError(f"{snippet}: a torchrun run is read as a RunResult on one rank only "
                             f"(torchrun interleaves the stdout of {world_size})")
        return torchrun_result(snippet, run_torchrun(snippet, 1, timeout=timeout))
    return run_snippet(snippet, world_size=world_size, timeout=timeout, fresh=snippet in RUN_FRESH)
