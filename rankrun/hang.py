"""A hang of ranks that wait for each other, declared as soon as the evidence is complete
instead of by a timeout.

    from rankrun.hang import HangWatch
    from rankrun.runner import run_snippet

    result = run_snippet(SNIPPET, 2, call="unsynced", timeout=600, hang=HangWatch())
    assert result.hung, result.failure_report()
    result.ranks[1].stack        # where rank 1 waited, dumped just before the kill (as on a timeout)
    result.hang_evidence         # what was seen: the interval, the samples, each rank's innermost frame

The runner declares the hang when, for `quiet` seconds without a break (looked at every
`every` seconds):

- every rank is still running, and the thread that runs the snippet is blocked in a collective:
  `blocked(frames)` holds for its Python stack (by default: one of its three innermost frames
  is in `torch/distributed/` or `deepspeed/comm/`, or is a `wait`, as on the handle of
  DeepSpeed's ZeRO-3 gather, under a decorator's frame or two);
- no rank's stack changed (every frame's file, line and function, sampled with faulthandler
  on SIGUSR2 into a file of the run's own, so stderr stays as the snippet wrote it);
- no rank wrote a byte to stdout or stderr;
- no rank used more than `cpu` of a core (a rank blocked in gloo sleeps; one that computes or
  moves data does not).

Then the run ends as a timed-out run does: each rank's stack is dumped to its stderr
(`RankResult.stack`), the ranks are killed, and `result.hung` is True (`result.ok` False,
`result.timed_out` False). A run that is not hung in that sense ends as before: on its own, by
fail-fast, or at `timeout`. Choose `quiet` far above the longest step of the snippet on a
loaded machine: a live run shows a changing stack or CPU use within a step.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rankrun.results import STACK_DUMP, printed_by_the_example

# One frame of a faulthandler dump: `  File "path", line N in function`.
FRAME = re.compile(r'^  File "(.*)", line (\d+) in (\S+)$')
# The rank's own frames (rankrun/rank_main.py): the thread that has them runs the snippet.
RANK_MAIN = str(Path(__file__).resolve().parent / "rank_main.py")
# Where a blocked collective waits in Python: torch.distributed's functions (barrier,
# all_reduce, ...) and DeepSpeed's comm layer; `wait` on a handle (DeepSpeed's ZeRO-3 gather).
COLLECTIVE_FILES = ("/torch/distributed/", "/deepspeed/comm/")


def in_a_collective(frames: list[tuple[str, int, str]]) -> bool:
    """The default `blocked`: one of the three innermost frames (frames[:3]) waits in a collective
    (decorators such as DeepSpeed's nvtx wrapper and torch's logger add frames around it)."""
    return any(any(part in path for part in COLLECTIVE_FILES) or function == "wait"
               for path, _, function in frames[:3])


@dataclass(frozen=True)
class HangWatch:
    """What counts as a hang (see the module docstring). Part of a run's identity in the run cache."""
    quiet: float = 5.0  # seconds of no progress on any rank, every rank blocked all along
    every: float = 0.5  # seconds between two looks
    cpu: float = 0.05  # the most CPU (cores) a blocked rank may use meanwhile
    blocked: Callable[[list[tuple[str, int, str]]], bool] = in_a_collective

    def key(self) -> dict:
        return {"quiet": self.quiet, "every": self.every, "cpu": self.cpu,
                "blocked": f"{self.blocked.__module__}.{self.blocked.__qualname__}"}


@dataclass
class HangEvidence:
    """What the runner saw before it declared the hang."""
    quiet: float  # seconds from the first look of the unbroken run of looks to the declaration
    looks: int  # looks in that run, all alike
    after: float  # seconds from the run's start to the declaration
    innermost: dict[int, str] = field(default_factory=dict)  # rank -> `function (file:line)`
    cpu: dict[int, float] = field(default_factory=dict)  # rank -> cores used over `quiet`
    # The longest earlier interval of the same run in which every look was alike and blocked, and
    # which then ended in progress: how long a live wait lasted here, against `quiet`.
    longest_live: float = 0.0

    def describe(self) -> str:
        return (f"hung: every rank blocked in a collective, no stack change, no output and no CPU use "
                f"(at most {max(self.cpu.values(), default=0):.3f} of a core) for {self.quiet:.1f} s "
                f"({self.looks} looks; the longest such wait that then went on: {self.longest_live:.1f} s)")


def snippet_thread(dump: str) -> list[tuple[str, int, str]] | None:
    """The frames (innermost first) of the thread of a faulthandler dump that runs the snippet
    (the one with rank_main.py's frames), without those frames; None if the dump has none."""
    threads, current = [], None
    for line in dump.splitlines():
        if STACK_DUMP.match(line):
            current = []
            threads.append(current)
        elif current is not None:
            match = FRAME.match(line)
            if match:
                current.append((match.group(1), int(match.group(2)), match.group(3)))
    for frames in threads:
        if any(path == RANK_MAIN for path, _, _ in frames):
            return [frame for frame in frames if frame[0] != RANK_MAIN and not frame[0].startswith("<frozen")]
    return None


def stacks_file(work: Path, rank: int) -> Path:
    """Where rank `rank` writes the stacks the watcher asks for (rank_main.probe_stacks_on_request)."""
    return work / f"rank{rank}.stacks"


class HangWatcher:
    """Looks at a run's ranks while the runner waits for them (launch.wait_for_ranks)."""

    def __init__(self, watch: HangWatch, pids: dict[int, int], work: Path, started: float):
        self.watch, self.pids, self.work, self.started = watch, pids, work, started
        self.next_look = 0.0
        self.since: float | None = None  # first look of the current unbroken run of alike looks
        self.looks = 0
        self.alike: tuple | None = None  # what every look of that run saw
        self.cpu_at_since: dict[int, float] = {}
        self.cpu_last: dict[int, float] = {}
        self.last_look: float | None = None
        self.last_alike: float | None = None  # the latest look of the current run of alike looks
        self.longest_live = 0.0
        self.evidence: HangEvidence | None = None

    def _reset(self) -> bool:
        if self.since is not None and self.last_alike is not None:  # that wait ended: it was live
            self.longest_live = max(self.longest_live, self.last_alike - self.since)
        self.since, self.alike, self.looks, self.last_alike = None, None, 0, None
        return False

    def _cpu(self, rank: int) -> float | None:
        try:
            times = psutil.Process(self.pids[rank]).cpu_times()
        except psutil.Error:
            return None
        return times.user + times.system

    def _dump(self, rank: int) -> str | None:
        """Ask rank `rank` for its stacks; what it wrote, or None if it cannot be asked yet."""
        path = stacks_file(self.work, rank)
        if not path.exists():  # not yet listening for SIGUSR2 (it would end the process)
            return None
        os.truncate(path, 0)  # the rank appends (O_APPEND): its next dump starts at 0
        try:
            os.kill(self.pids[rank], signal.SIGUSR2)
        except ProcessLookupError:
            return None
        deadline, length, grew_at = time.monotonic() + 1.0, -1, time.monotonic()
        while time.monotonic() < deadline:
            text = path.read_text(errors="replace")
            now = time.monotonic()
            if len(text) != length:
                length, grew_at = len(text), now
            elif text and now - grew_at > 0.03:
                return text
            time.sleep(0.005)
        return path.read_text(errors="replace") or None

    def __call__(self, codes: list) -> bool:
        """True once the hang is declared (self.evidence says what was seen)."""
        now = time.monotonic()
        if now < self.next_look:
            return False
        self.next_look = now + self.watch.every
        if any(code is not None for code in codes):  # a rank ended: not ranks waiting for each other
            return self._reset()
        cpu = {rank: self._cpu(rank) for rank in self.pids}
        if None in cpu.values():
            return self._reset()
        previous, self.cpu_last, last_look, self.last_look = self.cpu_last, cpu, self.last_look, now
        if previous and last_look is not None:
            spent = max(cpu[rank] - previous.get(rank, 0.0) for rank in cpu)
            if spent > self.watch.cpu * (now - last_look) + 0.01:  # 10 ms: the clock's granularity
                return self._reset()  # someone computes: not now, and do not disturb it
        seen = []
        for rank in sorted(self.pids):
            dump = self._dump(rank)
            frames = snippet_thread(dump) if dump else None
            if frames is None or not self.watch.blocked(frames):
                return self._reset()
            outputs = tuple((self.work / f"rank{rank}.{stream}").stat().st_size
                            if (self.work / f"rank{rank}.{stream}").exists() else 0 for stream in ("stdout", "stderr"))
            seen.append((tuple(frames), outputs))
        seen = tuple(seen)
        if seen != self.alike:
            self._reset()
            self.since, self.alike, self.looks, self.cpu_at_since, self.last_alike = now, seen, 1, cpu, now
            return False
        self.looks += 1
        self.last_alike = now
        quiet = now - self.since
        if quiet < self.watch.quiet:
            return False
        used = {rank: (cpu[rank] - self.cpu_at_since[rank]) / quiet for rank in cpu}
        if max(used.values()) > self.watch.cpu:
            return self._reset()
        self.evidence = HangEvidence(
            quiet=quiet, looks=self.looks, after=now - self.started, cpu=used, longest_live=self.longest_live,
            innermost={rank: f"{frames[0][2]} ({Path(frames[0][0]).name}:{frames[0][1]})"
                       for rank, (frames, _) in zip(sorted(self.pids), seen)})
        return True


# --- what a page shows of a hung run -----------------------------------------------------------

def frames_shown(stack: str, shown: re.Pattern) -> list[tuple[str, str]]:
    """(file, function) of the frames of a rank's dumped stack (its main thread) that `shown`
    matches, outermost first: where the rank waited, as a page shows it. `shown` captures the
    file's path, then the function."""
    main = stack.split("Current thread")[1]
    return [(m.group(1).split("/")[-1], m.group(2)) for m in shown.finditer(main)][::-1]


class HangTranscript:
    """What a page shows of a hung run, for expect_output: each rank's printed lines and where it
    waited (the frames `shown` matches)."""

    def __init__(self, result, watch: HangWatch, shown: re.Pattern):
        self.name, self.ok, self.result = result.name, True, result
        self.watch, self.shown = watch, shown

    def transcript(self) -> str:
        lines = [f"hung: no rank made progress for {self.watch.quiet:.0f} s, each waiting in a collective; "
                 "where each rank was:"]
        for rank in self.result.ranks:
            printed = printed_by_the_example(rank.stdout).strip() or f"[rank {rank.rank}] (printed nothing)"
            frames = " > ".join(f"{function} ({file})" for file, function in frames_shown(rank.stack, self.shown))
            lines += [printed, f"  {frames}"]
        return "\n".join(lines) + "\n"
