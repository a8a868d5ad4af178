"""What a run gives back: each rank's exit, output, exception and return value, and the
failure report that names the snippet, the ranks and the cause."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankrun.pages import pages_including
from rankrun.project import PEER_WENT_AWAY, ROOT, without_addresses

# Lines DeepSpeed itself writes to stdout (its logger and its op loader). They
# are not the example's output, so pages and output files leave them out.
DEEPSPEED_NOISE = re.compile(
    r"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] "
    r"|DeepSpeed \S+ built successfully$)"
)

# The first line of each thread in a faulthandler dump, and the frames of the runner below a snippet.
STACK_DUMP = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
HARNESS_FRAME = re.compile(r'^  File "(<frozen runpy>|' + re.escape(str(Path(__file__).resolve().parent)) + r'/rank_main\.py)"')


def printed_by_the_example(stdout: str) -> str:
    """The lines of `stdout` that the example printed itself, without DeepSpeed's log lines."""
    return "".join(line + "\n" for line in stdout.splitlines() if not DEEPSPEED_NOISE.match(line))


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
    left_running: list[str] = field(default_factory=list)  # "PID CMD" of processes the snippet left behind

    @property
    def ok(self) -> bool:
        # A rank the runner killed did not finish, whatever its exit status says: a pool worker
        # whose job ended on a peer's death, between the runner's kills, exits 0 itself.
        return (self.exit_code == 0 and self.exception is None and not self.left_running
                and not self.killed_by_runner)

    def _stack_start(self) -> int | None:
        lines = self.stderr.splitlines()
        starts = [i for i, line in enumerate(lines) if STACK_DUMP.match(line)]
        return starts[0] if self.killed_by_runner and starts else None

    @property
    def stack(self) -> str | None:
        """Where a rank the runner killed was: every thread's Python stack, dumped on request
        just before the kill (faulthandler's format, most recent call first), without the
        runner's own frames below the snippet; or None."""
        start = self._stack_start()
        if start is None:
            return None
        return "\n".join(line for line in self.stderr.splitlines()[start:] if not HARNESS_FRAME.match(line))

    @property
    def stderr_before_stack(self) -> str:
        start = self._stack_start()
        return self.stderr if start is None else "\n".join(self.stderr.splitlines()[:start])

    def cause(self) -> str:
        if self.exception:
            return f"{self.exception['name']}: {without_addresses(self.exception['message'])}"
        if self.killed_by_runner:
            return "killed by the runner (still running after the run ended)"
        if self.left_running:
            return "left a process running: " + "; ".join(self.left_running)
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
    port: int = 0  # MASTER_PORT of the run
    first_failure_seconds: float | None = None  # when the runner first saw a rank fail, from the start
    retried_because: str | None = None  # the failure report of a first attempt whose port was taken
    hung: bool = False  # declared hung by a hang watch (rankrun.hang): ranks waiting for each other
    hang_evidence: Any = None  # rankrun.hang.HangEvidence of a hung run

    @property
    def port_was_taken(self) -> bool:
        return any(rank.exception and "EADDRINUSE" in rank.exception["message"] for rank in self.ranks)

    @property
    def ok(self) -> bool:
        return not self.timed_out and not self.hung and all(rank.ok for rank in self.ranks)

    @property
    def name(self) -> str:
        try:
            return str(self.snippet.relative_to(ROOT))
        except ValueError:
            return str(self.snippet)

    @property
    def output(self) -> str:
        """What the example printed: every rank's stdout in rank order, DeepSpeed's log lines left out."""
        return "".join(printed_by_the_example(rank.stdout) for rank in self.ranks)

    @property
    def errors(self) -> list[str]:
        """Why the ranks that failed first failed, sorted and without repeats.

        `Type: message` for an exception, `rank N exited with code C` or
        `rank N killed by signal S` otherwise. Ranks that fail *because* a peer
        went away (gloo's "Connection closed by peer", with a port number that
        changes from run to run) are left out when there is another cause.
        """
        def causes(ranks):
            return {rank.cause() if rank.exception else f"rank {rank.rank} {rank.cause()}" for rank in ranks}

        first = causes(rank for rank in self.ranks if rank.rank in self.failed_first)
        # A rank that died without a word can be seen a poll later than the peer
        # that noticed it: then look at every rank that failed on its own.
        for candidates in (first, causes(rank for rank in self.ranks if not rank.ok and not rank.killed_by_runner)):
            root_causes = {cause for cause in candidates if not PEER_WENT_AWAY.search(cause)}
            if root_causes:
                return sorted(root_causes)
        return sorted(first)

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
        if self.hung and self.hang_evidence is not None:
            head += f": {self.hang_evidence.describe()}"
        parts = [head]
        pages = self.pages()
        if pages:
            parts.append(f"shown on {', '.join(pages)}")
        for rank in failed:
            parts.append(f"rank {rank.rank}: {rank.cause()}")
        for rank in first:
            detail = rank.exception["traceback"] if rank.exception else tail(rank.stderr_before_stack)
            if detail.strip():
                parts.append(f"--- rank {rank.rank} ---\n{detail.rstrip()}")
        for rank in failed:
            if rank.stack:
                parts.append(f"--- rank {rank.rank}: where it was when the runner killed it ---\n{rank.stack}")
        return "\n".join(parts)

    def pages(self) -> list[str]:
        """The pages (docs/...) that include this snippet with --8<--, whole or a section of it."""
        return pages_including(self.name)

    def check(self) -> RunResult:
        if not self.ok:
            raise SnippetFailed(self.failure_report())
        return self

    def returned(self, rank: int = 0) -> Any:
        return self.ranks[rank].returned


def assert_refused(result: RunResult, message: str) -> None:
    """The example refused the run before printing anything, with this one error (`Type: message`):
    what an example does at a rank count on which its printed figures were not checked."""
    assert not result.ok and result.errors == [message], result.failure_report()
    assert result.output == "", result.output


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])
