"""snippets/zero3/gathered_parameters.py: reading and changing a partitioned weight outside forward with
GatheredParameters; the change with modifier_rank=None is lost (with DeepSpeed's guard warning)."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches


GATHERED = "snippets/zero3/gathered_parameters.py"
GATHER_DEPRECATED = (
    "`torch.distributed.all_gather_into_tensor` is deprecated. "
    "Please use `torch.distributed.all_gather_single` instead."
)
GUARD = (
    "Detected in-place modification of ZeRO-3 parameters inside GatheredParameters with "
    "modifier_rank=None. Use modifier_rank=<rank> to broadcast updates across ranks."
)


def assert_grads_equal(got, want, label):
    assert got.keys() == want.keys(), label
    for name in want:
        assert_matches(got[name], want[name], f"{label} {name}")


@pytest.fixture(scope="module")
def gathered_reference():
    example = example_namespace(GATHERED)
    torch.manual_seed(example["SEED"])
    model = example["LanguageModel"]()  # GatheredParameters is a no-op without ZeRO-3
    weight = model.embeddings.weight.detach().clone()
    tokens, targets = example["make_batch"]()
    loss = F.cross_entropy(model(tokens).reshape(-1, example["VOCAB"]), targets.reshape(-1))
    loss.backward()
    return weight, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathered_parameters(world_size, gathered_reference, expect_output):
    weight, want_loss, want_grads = gathered_reference
    result = run_snippet(GATHERED, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["outside"] == ((0,), (16, 8))  # empty outside forward; real shape in ds_shape
        # modifier_rank=0 in __init__: every rank holds the changed (halved) weight...
        torch.testing.assert_close(got["full"], weight, rtol=0, atol=0)
        assert got["after"] == (0,)  # ...and it is partitioned again after the with block
        # modifier_rank=None: the change is visible inside, then silently discarded.
        inside, after = got["lost"]
        assert inside == 0.0
        assert_matches(after, weight.sum().item(), "sum after the block", scale=weight.abs().sum().item())
        # ...and nothing warns about it: the only Python warning or log record (WARNING and
        # above) raised during the two blocks is torch's deprecation notice for the gather.
        assert got["lost_warnings"] and set(got["lost_warnings"]) == {GATHER_DEPRECATED}, got["lost_warnings"]
        # modifier_rank=0 keeps rank 0's change: each rank wrote its own rank number, and
        # afterwards every rank holds rank 0's value (0.0), partitioned again.
        assert got["broadcast"] == ([0.0], (0,))
        assert_matches(got["loss"], want_loss, "loss")
        assert_grads_equal(got["grads"], want_grads, f"rank {rank}")
        assert got["guard"] == GUARD
    if world_size == 2:
        expect_output(result, output_file(GATHERED))
