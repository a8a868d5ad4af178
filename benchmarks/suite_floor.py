"""Benchmark: the suite's floor. Prints each figure against its target, with the load average.

    .venv/bin/python benchmarks/suite_floor.py [--snippet snippets/zero3/module_z3.py] [--skip-suite]

1. `python3 tasks.py test --changed` after editing one snippet (a comment line appended to
   --snippet, removed again afterwards), run twice: the first run after the edit, then the same
   command again (warm: the environment checked, DeepSpeed's op compiled, the notebook cache
   filled). Target <= 20 s.
2. The whole suite, `python3 tasks.py test`, as CI runs it after the install: pytest's wall
   time from its summary line, the harness's run summary (runs, distinct runs, rank seconds).
   Target <= 150 s on 2 idle cores; the runs must equal the distinct runs.

The fresh-clone `CI=true bash .ci/run` (target <= 6 min) is not run here: it reinstalls
everything; CI reports its time for every landing.

Each figure is wall-clock seconds next to the CPU seconds of the processes: on a shared,
loaded machine the wall time grows with the load and the CPU time much less, so the load
average is printed before and after each. Not part of the test suite: timings belong here.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed).*?) in ([\d.]+)s", re.M)
RUNS = re.compile(r"^rankrun: .*$", re.M)


def load() -> str:
    return "load average " + ", ".join(f"{value:.2f}" for value in os.getloadavg())


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    cpu, start = children_cpu(), time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return time.monotonic() - start, children_cpu() - cpu, done


def report(name: str, target: float, wall: float, cpu: float, done: subprocess.CompletedProcess,
           before: str) -> None:
    summary = SUMMARY.search(done.stdout)
    runs = RUNS.search(done.stdout)
    pytest_wall = float(summary.group(2)) if summary else None
    verdict = "meets" if (pytest_wall or wall) <= target else "misses"
    print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s CPU, exit {done.returncode}; target <= {target:.0f} s: {verdict}")
    if summary:
        print(f"  pytest: {summary.group(1)} in {summary.group(2)} s")
    if runs:
        print(f"  {runs.group(0)}")
    print(f"  {before} before, {load()} after")
    if done.returncode:
        print("  last lines:\n    " + "\n    ".join((done.stdout + done.stderr).strip().splitlines()[-15:]))


def changed_loop(snippet: Path) -> None:
    original = snippet.read_text()
    try:
        snippet.write_text(original + "# an edit, as an author makes one (benchmarks/suite_floor.py)\n")
        for attempt in ("first run after the edit", "the same command again (warm)"):
            before = load()
            wall, cpu, done = timed([sys.executable, "tasks.py", "test", "--changed"])
            report(f"tasks.py test --changed, {snippet.relative_to(ROOT)} edited, {attempt}", 20.0,
                   wall, cpu, done, before)
    finally:
        snippet.write_text(original)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snippet", type=Path, default=ROOT / "snippets" / "zero3" / "module_z3.py")
    parser.add_argument("--skip-suite", action="store_true", help="only the --changed loop")
    args = parser.parse_args()
    snippet = args.snippet if args.snippet.is_absolute() else ROOT / args.snippet
    print(f"{os.cpu_count()} CPUs; {load()}")
    changed_loop(snippet)
    if not args.skip_suite:
        before = load()
        wall, cpu, done = timed([sys.executable, "tasks.py", "test"])
        report("whole suite, tasks.py test", 150.0, wall, cpu, done, before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
