"""Benchmark: time per ZeRO-3 training step of snippets/zero3/trace_cache.py's model, with the
auxiliary head on every step, on odd steps only (the trace cache is invalidated), and called
on every step with a zero contribution (the same module order on every step).

    DS_ACCELERATOR=cpu .venv/bin/torchrun --nproc_per_node 2 benchmarks/trace_cache.py [rounds]

The three schedules are measured interleaved, so that a change of the machine's load falls on
all three alike: one engine each, and in every round each schedule runs two steps (one without
the head and one with it, for the odd-steps schedules), the order of the schedules rotated
from round to round. Prints, from rank 0: the load average before and after; per schedule the
median time per step over the rounds, its quartiles, and how often DeepSpeed invalidated the
trace; and the ratios of the schedules' times within each round, as the median over the rounds
with a distribution-free 95% confidence interval of that median. The first rounds (recording
the trace) are not counted. The example's config, without its switch that prints the message
(DeepSpeed's default). Not part of the test suite: timings belong here, not in asserts. The
model is tiny: the figures show DeepSpeed's bookkeeping, not the cost of gathering large
weights.
"""

import math
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

SNIPPET = Path(__file__).resolve().parent.parent / "snippets/zero3/trace_cache.py"
WARM_UP = 5
RATIOS = (("odd steps", "every step"), ("odd steps, always called", "every step"),
          ("odd steps", "odd steps, always called"))
INVALIDATIONS = [0]
BENCHMARKED = ("every step", "odd steps", "odd steps, always called")  # the example's, SGD


def count_invalidations():
    invalidate = PartitionedParameterCoordinator._invalidate_trace

    def counted(self):
        INVALIDATIONS[0] += 1
        invalidate(self)

    PartitionedParameterCoordinator._invalidate_trace = counted


def engine_for(example):
    world = torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": example["BATCH"] // world,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    torch.manual_seed(example["SEED"])
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = example["WithAuxiliaryHead"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=example["LR"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_step(example, engine, schedule, step):
    """The example's training step without what it records for the test (full gradients)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tokens = example["batch"](step)[rank::world].to(engine.device)
    logits = engine(tokens[:, :-1], aux=example["aux_mode"](schedule, step))
    loss = F.cross_entropy(logits.reshape(-1, example["VOCAB"]), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()


def median_interval(values, confidence=0.95):
    """The order statistics that bound the median with at least `confidence`, whatever the
    distribution: the number of values below the median is Binomial(n, 1/2)."""
    values, n = sorted(values), len(values)
    below = 0  # the largest k with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2
    cumulative = 0.0
    for k in range(n // 2 + 1):
        if cumulative + math.comb(n, k) / 2 ** n > (1 - confidence) / 2:
            below = k
            break
        cumulative += math.comb(n, k) / 2 ** n
    below = max(below, 1)
    return values[below - 1], values[n - below]


def load_average():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    example = runpy.run_path(str(SNIPPET), run_name="benchmark")
    schedules = list(BENCHMARKED)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    count_invalidations()
    engines = {schedule: engine_for(example) for schedule in schedules}
    say(f"load average before: {load_average()}", flush=True)
    seconds = {schedule: [] for schedule in schedules}
    invalidations = dict.fromkeys(schedules, 0)
    for index in range(WARM_UP + rounds):
        shift = index % len(schedules)
        for schedule in schedules[shift:] + schedules[:shift]:
            torch.distributed.barrier()
            before, start = INVALIDATIONS[0], time.perf_counter()
            for step in (2 * index, 2 * index + 1):
                train_step(example, engines[schedule], schedule, step)
            torch.distributed.barrier()
            if index >= WARM_UP:
                seconds[schedule].append((time.perf_counter() - start) / 2)
                invalidations[schedule] += INVALIDATIONS[0] - before
    say(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, "
        f"{torch.distributed.get_world_size()} ranks: {rounds} rounds after {WARM_UP} "
        "warm-up rounds,")
    say(f"each 2 steps of every schedule in turn ({2 * rounds} steps each)")
    say(f"{'schedule':26s} ms/step: median [quartiles]    trace invalidations")
    for schedule in schedules:
        ms = [s * 1e3 for s in seconds[schedule]]
        low, _, high = statistics.quantiles(ms, n=4)
        say(f"{schedule:26s} {statistics.median(ms):15.2f} [{low:6.2f}, {high:6.2f}]"
            f" {invalidations[schedule]:10d}")
    say("ratio of the times per step within a round: median over the rounds "
        "[95% CI of the median]")
    for slower, baseline in RATIOS:
        ratios = [a / b for a, b in zip(seconds[slower], seconds[baseline])]
        low, high = median_interval(ratios)
        say(f"  {slower + ' / ' + baseline:48s} {statistics.median(ratios):.3f} "
            f"[{low:.3f}, {high:.3f}]")
    say(f"load average after: {load_average()}", flush=True)


if __name__ == "__main__":
    main()
