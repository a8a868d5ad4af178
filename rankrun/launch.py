"""Starting a run's ranks as new processes (`fresh=True`, exactly like torchrun), waiting for
them with fail-fast, asking hung ranks for their stacks, and collecting what they left.
The warm pool (rankrun.pool) starts its ranks otherwise and shares the rest."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rankrun import project
from rankrun.project import ROOT
from rankrun.results import STACK_DUMP, RankResult, RunResult

RANK_MAIN = Path(__file__).resolve().parent / "rank_main.py"
# A fresh rank's file for the stacks a hang watcher asks for (rank_main.probe_stacks_on_request).
STACKS_VARIABLE = "RANKRUN_STACKS_FILE"


def kill_group(process: subprocess.Popen, wait: bool = True) -> None:
    """Kill the rank's whole process group (the rank and anything it started), and reap it
    unless `wait` is False."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        # No such group: the rank ended, or it has not called setsid yet (a pool worker the
        # zygote forked a moment ago is still in the zygote's group, and a runner that closes
        # a spare pool at once gets here). One not known to have ended is killed alone: it has
        # started nothing yet, and left alive it would wait for a job forever, and we for it.
        if process.poll() is None:
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    except PermissionError:
        pass
    if wait:
        process.wait()


# How long the runner waits for hung ranks to write their stacks before it kills them.
STACK_DUMP_WAIT = 2.0


def ask_for_stacks(pids: dict[int, int], work: Path, wait: float = STACK_DUMP_WAIT) -> None:
    """Ask the still-running ranks (rank -> pid) for their stacks (SIGUSR1: faulthandler, see
    rank_main.dump_stacks_on_request) and wait until each has written one to its stderr file
    in `work`, or `wait` seconds."""

    def stderr_of(rank: int) -> str:
        path = work / f"rank{rank}.stderr"
        return path.read_text(errors="replace") if path.exists() else ""

    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait
    pending = {rank: (-1, 0.0) for rank in pids}  # rank -> (length of its stderr, when it last grew)
    while pending and time.monotonic() < deadline:
        now = time.monotonic()
        for rank, (length, grew_at) in list(pending.items()):
            text = stderr_of(rank)
            if len(text) != length:
                pending[rank] = (len(text), now)
            elif now - grew_at > 0.1 and any(STACK_DUMP.match(line) for line in text.splitlines()):
                del pending[rank]  # it dumped, and has written nothing more for 0.1 s
        time.sleep(0.02)


def resolve_snippet(snippet: str | os.PathLike) -> Path:
    path = Path(snippet)
    if not path.is_absolute():
        path = ROOT / path
    if not path.is_file():
        raise FileNotFoundError(f"no snippet file at {path}")
    return path


def torchrun_environment(rank: int, world_size: int) -> dict[str, str]:
    """The variables torchrun sets for one local rank (MASTER_PORT is per run), plus the CPU accelerator."""
    environment = {
        "DS_ACCELERATOR": "cpu",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
    }
    if world_size > 1:
        # Like torchrun: one OpenMP thread per rank unless the caller chose otherwise
        # (torchrun: "to avoid your system being overloaded"; more ranks than cores here).
        environment["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return environment


@dataclass
class Waited:
    """How waiting for a run's ranks ended."""
    codes: list  # each rank's exit code, None for a rank still running
    failed_first: list[int]  # the ranks seen failing first
    failed_at: float | None  # when (time.monotonic()), or None
    timed_out: bool
    hung: bool = False  # a HangWatcher declared the hang (rankrun.hang)


def wait_for_ranks(poll, world_size: int, deadline: float, grace: float, watch=None) -> Waited:
    """Poll every rank until all are done, one failed `grace` seconds ago, the deadline passed,
    or `watch` (a rankrun.hang.HangWatcher, called with the exit codes) declared a hang.

    poll(rank) gives the rank's exit code, or None while it runs.
    """
    failed_first: list[int] = []
    first_failure_at = None
    while True:
        codes = [poll(rank) for rank in range(world_size)]
        now = time.monotonic()
        if first_failure_at is None:
            failed_first = [r for r, code in enumerate(codes) if code not in (None, 0)]
            if failed_first:
                first_failure_at = now
        if all(code is not None for code in codes):
            return Waited(codes, failed_first, first_failure_at, False)
        if first_failure_at is not None and now - first_failure_at > grace:
            return Waited(codes, failed_first, first_failure_at, False)
        if now > deadline:
            return Waited(codes, failed_first, first_failure_at, True)
        if watch is not None and first_failure_at is None and watch(codes):
            return Waited(codes, failed_first, first_failure_at, False, hung=True)
        time.sleep(0.01)


def collect(path: Path, work: Path, codes: list, pids: list[int], still_running: set[int], started: float,
            waited: Waited, timeout: float, port: int, watcher=None) -> RunResult:
    """The RunResult of a finished run from the files its ranks wrote in `work`."""
    ranks = []
    world_size = len(pids)
    for rank in range(world_size):
        report = {}
        report_file = work / f"rank{rank}.report"
        if report_file.exists() and rank not in still_running:
            with open(report_file, "rb") as handle:
                report = pickle.load(handle)
        ranks.append(
            RankResult(
                rank=rank,
                pid=pids[rank],
                exit_code=codes[rank],
                stdout=(work / f"rank{rank}.stdout").read_text(errors="replace"),
                stderr=(work / f"rank{rank}.stderr").read_text(errors="replace"),
                exception=report.get("exception"),
                returned=report.get("returned"),
                killed_by_runner=rank in still_running,
                left_running=report.get("left_running") or [],
            )
        )
    return RunResult(
        snippet=path, world_size=world_size, ranks=ranks, seconds=time.monotonic() - started,
        timed_out=waited.timed_out, timeout=timeout, failed_first=waited.failed_first, port=port,
        first_failure_seconds=None if waited.failed_at is None else waited.failed_at - started,
        hung=waited.hung, hang_evidence=watcher.evidence if watcher is not None and waited.hung else None,
    )


def hang_watcher(hang, pids: dict[int, int], work: Path, started: float):
    """A HangWatcher for the run when the caller asked for one (`hang`, a rankrun.hang.HangWatch)."""
    if hang is None:
        return None
    from rankrun.hang import HangWatcher

    return HangWatcher(hang, pids, work, started)


def run_fresh(path: Path, world_size: int, call, timeout: float, grace: float, env, hang=None) -> RunResult:
    """One new process per rank, like torchrun: slow to start, nothing shared with earlier runs."""
    port = project.free_port()
    started = time.monotonic()
    processes: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="snippet-run-") as workdir:
        work = Path(workdir)
        try:
            for rank in range(world_size):
                rank_env = {**os.environ, **torchrun_environment(rank, world_size), "MASTER_PORT": str(port), **(env or {})}
                if hang is not None:  # read and removed by rank_main before the snippet runs
                    rank_env[STACKS_VARIABLE] = str(work / f"rank{rank}.stacks")
                command = [sys.executable, str(RANK_MAIN), str(path), str(work / f"rank{rank}.report")]
                if call:
                    command.append(call)
                with open(work / f"rank{rank}.stdout", "wb") as out, open(work / f"rank{rank}.stderr", "wb") as err:
                    processes.append(subprocess.Popen(
                        command, cwd=ROOT, env=rank_env, stdin=subprocess.DEVNULL,
                        stdout=out, stderr=err, start_new_session=True,
                    ))
            watcher = hang_watcher(hang, {r: p.pid for r, p in enumerate(processes)}, work, started)
            waited = wait_for_ranks(lambda rank: processes[rank].poll(), world_size, started + timeout, grace, watcher)
        finally:
            still_running = {r for r, process in enumerate(processes) if process.poll() is None}
            ask_for_stacks({r: processes[r].pid for r in still_running}, work)
            for process in processes:  # every rank killed before any is reaped (RankPool.close)
                kill_group(process, wait=False)
            for process in processes:
                process.wait()
        codes = [process.returncode for process in processes]
        return collect(path, work, codes, [p.pid for p in processes], still_running, started, waited, timeout, port,
                       watcher)
