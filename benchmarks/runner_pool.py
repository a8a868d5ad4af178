"""Benchmark: the runner's warm rank pool against fresh processes, and the whole suite.

    .venv/bin/python benchmarks/runner_pool.py [--cold-runs 5] [--warm-runs 20] [--skip-suite]

Measures, in one run, on the same trivial 2-rank snippet (tests/runner_cases/hello.py):
cold (new processes per run, like torchrun) vs warm pool time per snippet, the slope
of pool time per added snippet, and the wall time of the whole test suite. Prints a
table of medians. Not part of the test suite: timings belong here, not in asserts.
Targets: warm median <= 0.5 s and >= 20x faster than cold; suite < 60 s on a warm
machine (after DeepSpeed's one-time op build).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from runner import close_pools, run_snippet  # noqa: E402

SNIPPET = ROOT / "tests" / "runner_cases" / "hello.py"


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

    points = []
    for count in (1, 5, 10, 20):
        started = time.perf_counter()
        for _ in range(count):
            timed_run()
        points.append((count, time.perf_counter() - started))
    close_pools()

    suite = None
    if not args.skip_suite:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                              capture_output=True, text=True)
        suite = time.perf_counter() - started
        summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "(no output)"

    cold_median, warm_median = statistics.median(cold), statistics.median(warm)
    rows = [
        ("cold run, new processes (median)", f"{cold_median:.2f} s", f"{args.cold_runs} runs"),
        ("pool start (once per session)", f"{pool_start:.2f} s", "1 run"),
        ("warm run, pool (median)", f"{warm_median:.3f} s", f"{args.warm_runs} runs"),
        ("cold / warm", f"{cold_median / warm_median:.0f}x", "target >= 20x"),
        ("pool slope per added snippet", f"{slope(points):.3f} s", f"fit over {[n for n, _ in points]} snippets"),
    ]
    if suite is not None:
        rows.append(("whole test suite (wall)", f"{suite:.1f} s", summary))
    width = max(len(name) for name, _, _ in rows)
    print(f"{'measure'.ljust(width)}  {'value':>9}  note")
    for name, value, note in rows:
        print(f"{name.ljust(width)}  {value:>9}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
