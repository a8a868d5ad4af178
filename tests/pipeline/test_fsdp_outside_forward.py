"""snippets/pipeline/fsdp_outside_forward.py: a weight FSDP shards, read by a method called
directly or by the model called without its wrapper, raises under FSDP1 (both values of
use_orig_params) and FSDP2; a unit or group of its own for the embedding raises too; one call of
the wrapped model's forward, and FSDP2's register_fsdp_forward_method, train as one process.
On 2 and 4 ranks, 3 steps, every weight compared."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/pipeline/fsdp_outside_forward.py"
VIEW = ("RuntimeError: Output 0 of View is a view and its base or another view of its base has "
        "been modified inplace. This view is the output of a function that returns multiple "
        "views. Such functions do not allow the output views to be modified inplace. You should "
        "replace the inplace operation by an out-of-place one.")
NOT_2D = "RuntimeError: 'weight' must be 2-D"
MIXED = ("RuntimeError: aten.embedding.default got mixed torch.Tensor and DTensor, need to convert "
         "all torch.Tensor to DTensor before calling distributed operators!")
NOT_ROOT = ("AssertionError: Non-root FSDP instance's `_is_root` should not have been set yet or "
            "should have been set to `False`")
LAZY = ("RuntimeError: FSDP state has already been lazily initialized for embed\n"
        "FSDP requires running forward through the root module first")


def train_in_one_process(ex):
    """The same model, seed, noise and SGD on the whole batch, without FSDP (the ranks' shares
    are equal, so the mean of their losses is the whole batch's loss)."""
    torch.manual_seed(ex["SEED"])
    model = ex["LanguageModel"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    tokens, targets, noise = ex["batch"]()
    losses = []
    for step in range(ex["STEPS"]):
        logits = model(tokens, noise=ex["NOISE"] * noise[step])
        loss = F.cross_entropy(logits.reshape(-1, ex["VOCAB"]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def expected_raise(ex):
    method, unwrapped = ex["METHOD"], ex["UNWRAPPED"]
    return {("FSDP1", method): VIEW,
            ("FSDP1, use_orig_params=True", method): NOT_2D,
            ("FSDP2", method): MIXED,
            ("FSDP1", unwrapped): VIEW,
            ("FSDP1, use_orig_params=True", unwrapped): NOT_2D,
            ("FSDP1, the embedding in a unit of its own", method): NOT_ROOT,
            ("FSDP2, the embedding in a group of its own", method): LAZY}


@pytest.mark.parametrize("world_size", [2, 4])
def test_reads_outside_the_forward_raise_and_the_fixes_train_as_one_process(world_size,
                                                                             expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    ex = example_namespace(SNIPPET)
    ref_losses, ref_weights = train_in_one_process(ex)
    raising = expected_raise(ex)
    fixed = [case for case in ex["CASES"] if case not in raising]
    assert len(fixed) == 4, fixed
    for rank in range(world_size):
        got = result.returned(rank)
        assert list(got) == ex["CASES"]
        for case, message in raising.items():
            assert got[case] == {"raised": message}, (rank, case)
        for case in fixed:
            label = f"rank {rank}, {case}"
            assert_matches(got[case]["losses"], ref_losses, f"{label} losses")
            assert sorted(got[case]["weights"]) == sorted(ref_weights), label
            for name, weight in ref_weights.items():
                assert_matches(got[case]["weights"][name], weight, f"{label} {name}")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, ("ValueError: 8 samples do not split evenly over 3 ranks; "
                            "run on 2 or 4 ranks"))
