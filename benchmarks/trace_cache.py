"""Benchmark: time per ZeRO-3 training step of snippets/zero3/trace_cache.py's model, with the
auxiliary head on every step, on odd steps only (the trace cache is invalidated), and called
on every step with a zero contribution (the same module order on every step).

    DS_ACCELERATOR=cpu .venv/bin/torchrun --nproc_per_node 2 benchmarks/trace_cache.py [steps]

Prints, from rank 0, the median and the minimum time per step after the first (the first
records the trace), each schedule measured in turn, and the load average of the machine before
and after. Not part of the test suite: timings belong here, not in asserts. The model is tiny:
the figures show DeepSpeed's bookkeeping, not the cost of gathering large weights.
"""

import os
import runpy
import statistics
import sys
import time
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

SNIPPET = Path(__file__).resolve().parent.parent / "snippets/zero3/trace_cache.py"


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    example = runpy.run_path(str(SNIPPET), run_name="benchmark")
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    if rank == 0:
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for schedule in example["SCHEDULES"]:
        engine = example["engine_for"]()
        seconds = []
        for step in range(steps):
            torch.distributed.barrier()
            start = time.perf_counter()
            example["train_step"](engine, schedule, step)
            seconds.append(time.perf_counter() - start)
        if rank == 0:
            after_first = seconds[1:]
            print(f"{schedule:26s} median {statistics.median(after_first) * 1e3:7.2f} ms/step, "
                  f"min {min(after_first) * 1e3:7.2f} ms ({steps - 1} steps)", flush=True)
    if rank == 0:
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
