"""snippets/zero3/change_after_initialize.py: a change made after deepspeed.initialize is undone by the
optimizer's step; the ways that keep it."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet


CHANGE = "snippets/zero3/change_after_initialize.py"


def plain_change_losses():
    """The losses plain PyTorch computes for the same model and inputs at weights 0.5, 1.0, 3.0."""
    example = example_namespace(CHANGE)
    losses = {}
    for value in (0.5, 1.0, 3.0):
        torch.manual_seed(example["SEED"])
        model = torch.nn.Sequential(torch.nn.Linear(example["DIM"], example["DIM"]), torch.nn.Linear(example["DIM"], 1))
        with torch.no_grad():
            model[0].weight.fill_(value)
        losses[value] = round(model(torch.ones(example["BATCH"], example["DIM"])).square().mean().item(), 4)
    return losses


@pytest.mark.parametrize("world_size", [2, 4])
def test_change_after_initialize(world_size, expect_output):
    plain = plain_change_losses()
    result = run_snippet(CHANGE, world_size, call="main").check()
    for rank in range(world_size):
        for name, seen in result.returned(rank).items():
            label = f"rank {rank} {name}"
            # A change before deepspeed.initialize stays.
            assert seen["before initialize"] == [0.5], label
            assert seen["loss at 0.5"] == plain[0.5], label
            # GatheredParameters(modifier_rank=0) after initialize: the next forward computes
            # with the change, then engine.step() (lr=0.0) puts the old values back.
            assert seen["undone"] == ([1.0], plain[1.0], [0.5]), label
            # safe_set_full_fp32_param alone: the step computes with the old weight, then keeps the new one.
            assert seen["fp32"] == ([0.5], plain[0.5], [2.0]), label
            # Both: the step computes with the new weight and keeps it, in both copies.
            assert seen["both"] == ([3.0], plain[3.0], [3.0], [3.0]), label
        state_before, state_after, reset = result.returned(rank)["Adam"]["state"]
        assert state_before.abs().sum() > 0  # Adam has a state for this weight...
        torch.testing.assert_close(state_after, state_before, rtol=0, atol=0)  # ...that the change left as it was
        assert reset == [[0.0], [0.0]]  # safe_set_full_optimizer_state resets it
    if world_size == 2:
        expect_output(result, output_file(CHANGE))
