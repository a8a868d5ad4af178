"""Benchmark: starting warm rank processes with the standard library's forkserver against the
harness's zygote (rankrun/rank_main.py): which is faster; the figures decide.

    .venv/bin/python benchmarks/forkserver_vs_zygote.py [--runs 10]

Both preload the same modules once (WARM_IMPORTS: torch, DeepSpeed, Transformers, ...), then
start 2 processes per round and wait until both are up and have answered. Printed: the
one-time start (preloading), and the median seconds per round of 2 processes. Not part of the
test suite: timings belong here, not in asserts.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

from rankrun import rank_main
from rankrun.runner import RankPool, close_zygotes


def answer(queue) -> None:
    queue.put(os.getpid())


def forkserver_rounds(runs: int) -> tuple[float, list[float]]:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "deepspeed", *rank_main.WARM_IMPORTS])
    queue = context.Queue()
    started = time.perf_counter()
    first = context.Process(target=answer, args=(queue,))
    first.start()
    queue.get()
    first.join()
    start_seconds = time.perf_counter() - started
    rounds = []
    for _ in range(runs):
        began = time.perf_counter()
        processes = [context.Process(target=answer, args=(queue,)) for _ in range(2)]
        for process in processes:
            process.start()
        for _ in processes:
            queue.get()
        for process in processes:
            process.join()
        rounds.append(time.perf_counter() - began)
    return start_seconds, rounds


def zygote_rounds(runs: int) -> tuple[float, list[float]]:
    started = time.perf_counter()
    RankPool(2).wait_until_ready()  # the first pool starts the zygote: its imports
    start_seconds = time.perf_counter() - started
    rounds = []
    for _ in range(runs):
        began = time.perf_counter()
        pool = RankPool(2)
        pool.wait_until_ready()
        pool.close()
        rounds.append(time.perf_counter() - began)
    close_zygotes()
    return start_seconds, rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (on {os.cpu_count()} cores)")
    rows = []
    for name, measure in [("stdlib forkserver", forkserver_rounds), ("rankrun zygote", zygote_rounds)]:
        start_seconds, rounds = measure(args.runs)
        rows.append((name, start_seconds, statistics.median(rounds)))
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"\n{'how':<20} {'start (once)':>14} {'2 processes (median)':>22}")
    for name, start_seconds, median in rows:
        print(f"{name:<20} {start_seconds:>12.2f} s {median:>20.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
