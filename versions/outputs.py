"""What a rank's output means to the version matrix: the lines the example printed itself (not
DeepSpeed's or torch's), the exception a rank raised, whether it aborted at exit, and the part
of a command's outcome that must be the same on every run."""

from __future__ import annotations

import re

from rankrun.project import PEER_WENT_AWAY, without_addresses


# Lines DeepSpeed itself writes to stdout (its logger, its op loader): not the example's output.
# The same filter as the test runner's (rankrun/runner.py, DEEPSPEED_NOISE).
DEEPSPEED_NOISE = re.compile(
    r"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] "
    r"|DeepSpeed \S+ built successfully$)"
)
ABORT_AT_EXIT = "terminate called without an active exception"
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


# Terminal colour and bold codes inside a message (torch's weights-only error has them): not text.
TERMINAL_STYLE = re.compile(r"\x1b\[[0-9;]*m")


# What older releases also print to stdout themselves: their op loader and torch's extension
# builder, and their configuration, logged as JSON over many lines (only the first line has the
# logger's prefix). Lines of such a dump are recognised on their own, so that filtering twice
# changes nothing (the data file keeps filtered output; a wider filter applies to it later).
OLDER_NOISE = re.compile(
    r"^(ninja: no work to do\.$|Time to load \S+ op: [\d.e+-]+ seconds$"
    r"|Parameter Offload: Total persistent parameters: \d+ in \d+ params$"
    r"|Parameter Offload - Persistent parameters statistics: param_count = \d+, numel = \d+$"
    r"|Using \S+ as PyTorch extensions root\.\.\.$|Emitting ninja build file |Building extension module "
    r"|Loading extension module |Allowing ninja to set a default number of workers"
    r'|\s*"[^"]+": .*$|\s*[{}\]],?\s*$)'
)


def printed(stdout: str) -> str:
    """What the example printed itself: stdout without the lines DeepSpeed and torch write."""
    return "".join(line + "\n" for line in stdout.splitlines()
                   if not DEEPSPEED_NOISE.match(line) and not OLDER_NOISE.match(line))


def last_exception(stderr: str) -> str | None:
    """The `Type: message` line of the last traceback in a rank's stderr, if it has one."""
    lines = [RANK_PREFIX.sub("", line) for line in stderr.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1:]:
        if line and not line[0].isspace():
            return without_addresses(TERMINAL_STYLE.sub("", line.rstrip()))
    return None


def compared(outcome: dict) -> dict:
    """The part of a run that must be the same every time: what each rank printed, the
    exceptions raised (by any rank: when one rank fails, torchrun stops the others, so which
    rank gets to raise first varies), and whether the command succeeded. An abort at exit is a
    failed command like any other (the examples end so that none can happen); the runs where
    one happened are also counted apart."""
    raised = sorted({rank["raised"] for rank in outcome["ranks"] if rank["raised"]})
    raised = [error for error in raised if not PEER_WENT_AWAY.search(error)] or raised
    return {"printed": [rank["printed"] for rank in outcome["ranks"]], "raised": raised,
            "ok": outcome["exit"] == 0, "timed_out": outcome["timed_out"]}
