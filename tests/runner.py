"""Run one snippet file on N local ranks, the way `torchrun` would, and report.

    result = run_snippet("snippets/zero3/language_model.py", world_size=2)
    result.check()              # raises SnippetFailed naming the snippet and rank
    result.output               # what the ranks printed, rank by rank
    result.ranks[1].exception   # {"type", "name", "message", "traceback"} or None

Each rank is a fresh `python tests/rank_main.py` process with the environment
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) plus DS_ACCELERATOR=cpu, so the snippet's own
`deepspeed.init_distributed(dist_backend="gloo")` works unchanged.

Fail fast: once a rank has failed, the others get `grace` seconds to finish or
fail on their own, then they are killed (they are usually blocked in a
collective and gloo would wait 30 minutes). A whole run is bounded by
`timeout`. Every process a run starts, and its children, is killed before
`run_snippet` returns, whatever happened.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = ROOT / "snippets"
RANK_MAIN = Path(__file__).resolve().parent / "rank_main.py"

# Lines DeepSpeed itself writes to stdout (its logger and its op loader). They
# are not the example's output, so pages and output files leave them out.
DEEPSPEED_NOISE = re.compile(
    r"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] "
    r"|DeepSpeed \S+ built successfully$)"
)


class SnippetFailed(AssertionError):
    """A snippet run did not succeed; the message names the snippet, the rank and the cause."""


@dataclass
class RankResult:
    rank: int
    pid: int
    exit_code: int | None  # negative: killed by that signal
    stdout: str
    stderr: str
    exception: dict | None = None  # {"type", "name", "message", "traceback"}
    returned: Any = None  # what the called function returned (call=... runs only)
    killed_by_runner: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.exception is None

    def cause(self) -> str:
        if self.exception:
            return f"{self.exception['name']}: {self.exception['message']}"
        if self.killed_by_runner:
            return "killed by the runner (still running after the run ended)"
        if self.exit_code is not None and self.exit_code < 0:
            return f"killed by signal {signal.Signals(-self.exit_code).name}"
        return f"exited with code {self.exit_code}"


@dataclass
class RunResult:
    snippet: Path
    world_size: int
    ranks: list[RankResult]
    seconds: float
    timed_out: bool = False
    timeout: float = 0.0
    failed_first: list[int] = field(default_factory=list)  # ranks that failed before the runner stepped in

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rank.ok for rank in self.ranks)

    @property
    def name(self) -> str:
        try:
            return str(self.snippet.relative_to(ROOT))
        except ValueError:
            return str(self.snippet)

    @property
    def output(self) -> str:
        """What the example printed: every rank's stdout in rank order, DeepSpeed's log lines left out."""
        lines = []
        for rank in self.ranks:
            lines += [line for line in rank.stdout.splitlines() if not DEEPSPEED_NOISE.match(line)]
        return "".join(line + "\n" for line in lines)

    @property
    def errors(self) -> list[str]:
        """Distinct `Type: message` lines of the exceptions raised by the ranks that failed first.

        Ranks that fail later usually fail *because* of the first ones (gloo's
        "Connection closed by peer"), with messages that change from run to run.
        """
        return sorted({rank.cause() for rank in self.ranks if rank.exception and rank.rank in self.failed_first})

    def transcript(self) -> str:
        """What an output file holds: the printed output, then the exceptions raised, if any."""
        return self.output + "".join(line + "\n" for line in self.errors)

    def failure_report(self) -> str:
        if self.ok:
            return f"{self.name} succeeded on {self.world_size} ranks"
        failed = [rank for rank in self.ranks if not rank.ok]
        first = [rank for rank in failed if rank.rank in self.failed_first] or failed
        head = f"{self.name} failed on {self.world_size} ranks after {self.seconds:.1f}s"
        if self.timed_out:
            head += f": timed out after {self.timeout:.0f}s"
        parts = [head]
        for rank in failed:
            parts.append(f"rank {rank.rank}: {rank.cause()}")
        for rank in first:
            detail = rank.exception["traceback"] if rank.exception else _tail(rank.stderr)
            if detail.strip():
                parts.append(f"--- rank {rank.rank} ---\n{detail.rstrip()}")
        return "\n".join(parts)

    def check(self) -> RunResult:
        if not self.ok:
            raise SnippetFailed(self.failure_report())
        return self

    def returned(self, rank: int = 0) -> Any:
        return self.ranks[rank].returned


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the rank's whole process group (the rank and anything it started)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def resolve_snippet(snippet: str | os.PathLike) -> Path:
    path = Path(snippet)
    if not path.is_absolute():
        path = ROOT / path
    if not path.is_file():
        raise FileNotFoundError(f"no snippet file at {path}")
    return path


def run_snippet(
    snippet: str | os.PathLike,
    world_size: int = 2,
    *,
    call: str | None = None,
    timeout: float = 120.0,
    grace: float = 3.0,
    env: dict[str, str] | None = None,
) -> RunResult:
    """Run `snippet` on `world_size` local ranks; see the module docstring.

    call: the name of a function in the snippet to call instead of running it as
    `__main__`; its return value (picklable) comes back in `RankResult.returned`.
    """
    path = resolve_snippet(snippet)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    port = free_port()
    started = time.monotonic()
    processes: list[subprocess.Popen] = []
    failed_first: list[int] = []
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="snippet-run-") as workdir:
        work = Path(workdir)
        files = []
        try:
            for rank in range(world_size):
                rank_env = dict(os.environ)
                rank_env.update(
                    DS_ACCELERATOR="cpu",
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(world_size),
                    LOCAL_WORLD_SIZE=str(world_size),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    PYTHONUNBUFFERED="1",
                )
                rank_env.update(env or {})
                stdout = open(work / f"rank{rank}.stdout", "wb")
                stderr = open(work / f"rank{rank}.stderr", "wb")
                files += [stdout, stderr]
                command = [sys.executable, str(RANK_MAIN), str(path), str(work / f"rank{rank}.report")]
                if call:
                    command.append(call)
                processes.append(
                    subprocess.Popen(
                        command, cwd=ROOT, env=rank_env, stdin=subprocess.DEVNULL,
                        stdout=stdout, stderr=stderr, start_new_session=True,
                    )
                )
            deadline = started + timeout
            first_failure_at = None
            while True:
                codes = [process.poll() for process in processes]
                if all(code is not None for code in codes):
                    break
                now = time.monotonic()
                newly_failed = [r for r, code in enumerate(codes) if code not in (None, 0) and r not in failed_first]
                if newly_failed and first_failure_at is None:
                    first_failure_at = now
                    failed_first = newly_failed
                if first_failure_at is not None and now - first_failure_at > grace:
                    break
                if now > deadline:
                    timed_out = True
                    break
                time.sleep(0.02)
        finally:
            still_running = {r for r, process in enumerate(processes) if process.poll() is None}
            for process in processes:
                _kill_group(process)
            for handle in files:
                handle.close()
        ranks = []
        for rank, process in enumerate(processes):
            report = {}
            report_file = work / f"rank{rank}.report"
            if report_file.exists():
                with open(report_file, "rb") as handle:
                    report = pickle.load(handle)
            ranks.append(
                RankResult(
                    rank=rank,
                    pid=process.pid,
                    exit_code=process.returncode,
                    stdout=(work / f"rank{rank}.stdout").read_text(errors="replace"),
                    stderr=(work / f"rank{rank}.stderr").read_text(errors="replace"),
                    exception=report.get("exception"),
                    returned=report.get("returned"),
                    killed_by_runner=rank in still_running,
                )
            )
    return RunResult(
        snippet=path,
        world_size=world_size,
        ranks=ranks,
        seconds=time.monotonic() - started,
        timed_out=timed_out,
        timeout=timeout,
        failed_first=failed_first,
    )
