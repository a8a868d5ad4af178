"""Benchmark: the runner's warm rank pool against fresh processes, and the whole suite.

    .venv/bin/python benchmarks/runner_pool.py [--cold-runs 5] [--warm-runs 20] [--skip-suite]

Measures, in one run, on the same trivial 2-rank snippet (rankrun/tests/cases/hello.py):
cold (new processes per run, like torchrun) vs warm pool time per snippet, a run right
after a failed one (the pool is rebuilt: forked from the zygote), the slope of pool
time per added snippet, and the wall time of the test suite, whole and --quick, run
as `python3 tasks.py test` runs it. Prints a table of medians. Not part of the test
suite: timings belong here, not in asserts. Targets: warm median <= 0.5 s and >= 20x
faster than cold; suite < 60 s on a warm machine (after DeepSpeed's one-time op build).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rankrun.runner import close_pools, run_snippet
from devtasks.child_env import environment
from devtasks.suite import pytest_arguments

ROOT = Path(__file__).resolve().parent.parent

SNIPPET = ROOT / "rankrun" / "tests" / "cases" / "hello.py"
FAILING = ROOT / "rankrun" / "tests" / "cases" / "raise_on_rank1.py"


def timed_suite(*options: str) -> tuple[float, str]:
    """Wall seconds of the suite run as `python3 tasks.py test [options]` runs it, and pytest's summary line."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_arguments(list(options))],
                          cwd=ROOT, env=environment(), capture_output=True, text=True)
    seconds = time.perf_counter() - started
    lines = done.stdout.strip().splitlines()
    return seconds, (lines[-1].strip("= ") if lines else "(no output)")


def timed_run(**options) -> float:
    started = time.perf_counter()
    run_snippet(SNIPPET, world_size=2, **options).check()
    return time.perf_counter() - started


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of total seconds against number of snippets."""
    xs, ys = zip(*points)
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold-runs", type=int, default=5)
    parser.add_argument("--warm-runs", type=int, default=20)
    parser.add_argument("--skip-suite", action="store_true", help="do not time the whole test suite")
    args = parser.parse_args()
    if args.cold_runs < 1 or args.warm_runs < 2:
        parser.error("need at least 1 cold run and 2 warm runs")

    cold = [timed_run(fresh=True) for _ in range(args.cold_runs)]
    started = time.perf_counter()
    timed_run()  # starts the pool: paid once per session, reported apart
    pool_start = time.perf_counter() - started
    warm = [timed_run() for _ in range(args.warm_runs)]

    after_failure = []
    for _ in range(5):
        assert not run_snippet(FAILING, world_size=2, grace=1).ok  # kills the pool
        after_failure.append(timed_run())

    points = []
    for count in (1, 5, 10, 20):
        started = time.perf_counter()
        for _ in range(count):
            timed_run()
        points.append((count, time.perf_counter() - started))
    close_pools()

    suites = []
    if not args.skip_suite:
        suites.append(("whole test suite (wall)", *timed_suite()))
        suites.append(("suite --quick: examples and pages", *timed_suite("--quick")))

    cold_median, warm_median = statistics.median(cold), statistics.median(warm)
    rows = [
        ("cold run, new processes (median)", f"{cold_median:.2f} s", f"{args.cold_runs} runs"),
        ("pool start (once per session)", f"{pool_start:.2f} s", "1 run"),
        ("warm run, pool (median)", f"{warm_median:.3f} s", f"{args.warm_runs} runs"),
        ("cold / warm", f"{cold_median / warm_median:.0f}x", "target >= 20x"),
        ("run after a failed run (median)", f"{statistics.median(after_failure):.2f} s",
         "5 runs; the pool is forked anew from the zygote"),
        ("pool slope per added snippet", f"{slope(points):.3f} s", "fit over " + ", ".join(f"{n} in {t:.2f} s" for n, t in points)),
    ]
    for name, seconds, summary in suites:
        rows.append((name, f"{seconds:.1f} s", summary))
    width = max(len(name) for name, _, _ in rows)
    print(f"{'measure'.ljust(width)}  {'value':>9}  note")
    for name, value, note in rows:
        print(f"{name.ljust(width)}  {value:>9}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
