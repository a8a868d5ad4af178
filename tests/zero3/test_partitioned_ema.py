"""snippets/zero3/partitioned_ema.py: an EMA kept per rank on the rank's own fp32 partition
equals the EMA of the same training in one process, and each rank holds only its share."""

import math

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

EMA = "snippets/zero3/partitioned_ema.py"


def ema_without_deepspeed():
    example = example_namespace(EMA)
    torch.manual_seed(example["SEED"])
    model = example["build_model"]()
    optimizer = torch.optim.Adam(model.parameters(), lr=example["LR"])
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step in range(example["STEPS"]):
        inputs, targets = example["make_batch"](step)
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        for name, param in model.named_parameters():
            ema[name].mul_(example["DECAY"]).add_(param.detach(), alpha=1 - example["DECAY"])
    return ema


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_partitioned_ema_equals_the_one_process_ema(world_size, expect_output):
    want = ema_without_deepspeed()
    result = run_snippet(EMA, world_size, call="main").check()
    returned = [result.returned(rank) for rank in range(world_size)]
    for rank, got in enumerate(returned):
        # The gathered EMA (the page's full_ema) on every rank.
        assert_matches(got["full"], want, f"rank {rank}: full EMA")
        # Each rank holds its slice only: ceil(numel / world) values of every weight.
        assert got["held"] == sum(math.ceil(t.numel() / world_size) for t in want.values())
        assert got["whole"] == sum(t.numel() for t in want.values())
    # The ranks' local slices, put together in rank order, are the one-process EMA: nothing
    # was gathered to compute them.
    for name, full in want.items():
        joined = torch.cat([got["local"][name] for got in returned])[:full.numel()].view(full.shape)
        assert_matches(joined, full, f"local slices of {name}")
    if world_size == 2:
        expect_output(result, output_file(EMA))
