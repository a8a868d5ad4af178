"""snippets/zero3/list_read_sizes.py: the checker's example (a weight read through a list) fails
in the first step whatever its size and whether stage3_param_persistence_threshold is 0 or
DeepSpeed's default; with the checker's fix the large one trains like one process. After the
first step, the default threshold keeps the small weight whole wherever the training loop looks
at it, and the large one only after a forward."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace, train_in_one_process
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun import marks

SNIPPET = "snippets/zero3/list_read_sizes.py"
EX = example_namespace(SNIPPET)
SMALL, LARGE = EX["SMALL"], EX["LARGE"]


def mismatch(width):
    return f"RuntimeError: size mismatch, got input (10), mat (10x{width}), vec (0)"


def train_in_one_process_at(size):
    """The same model, seed, batches and SGD in one process, without DeepSpeed."""
    torch.manual_seed(EX["SEED"])
    model = EX["ReadThroughAList"](*size)
    batches = [EX["batch"](step, size[0]) for step in range(EX["STEPS"])]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, size[0]), targets.reshape(-1))
    return train_in_one_process(model, batches, loss_fn, EX["LR"])


@pytest.fixture(scope="module")
def run():
    return run_snippet(SNIPPET, 2, call="main", timeout=300).check()


def test_the_read_fails_in_the_first_step_at_either_size_and_threshold(run):
    for rank in range(2):
        cases = run.returned(rank)["cases"]
        for case, width in (("small, threshold 0", SMALL[1]), ("small, defaults", SMALL[1]),
                            ("large, defaults", LARGE[1])):
            assert cases[case]["error"] == mismatch(width), (rank, case)
            assert cases[case]["losses"] == [], (rank, case)  # step 0 already failed
        # The checker's line trains the large model at DeepSpeed's defaults like one process.
        fixed = cases["large, defaults, registered"]
        assert fixed["error"] is None
        assert_same_training(fixed, train_in_one_process_at(LARGE), f"rank {rank} registered")


def test_what_the_training_loop_finds_after_each_phase(run, expect_output):
    """Rows of the weight after forward / backward / step, steps 0 to 2 (0: partitioned)."""
    def rows(first, later):
        return [dict(zip(("forward", "backward", "step"), first))] + [
            dict(zip(("forward", "backward", "step"), later))] * (EX["STEPS"] - 1)
    small, large = SMALL[0], LARGE[0]
    want = {
        "small, threshold 0": rows((0, 0, 0), (small, 0, 0)),
        "small, threshold 0, reuse distance 0": rows((0, 0, 0), (small, 0, 0)),
        "small, defaults": rows((0, small, small), (small, small, small)),
        "large, defaults": rows((0, 0, 0), (large, 0, 0)),
    }
    for rank in range(2):
        seen = run.returned(rank)["seen"]
        for case, expected in want.items():
            assert seen[case]["error"] is None, (rank, case)
            assert seen[case]["seen"] == expected, (rank, case, seen[case]["seen"])
            # Registered, each trains like one process whatever the settings.
            size = LARGE if case.startswith("large") else SMALL
            assert_same_training(seen[case], train_in_one_process_at(size), f"{rank} {case}")
    expect_output(run, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main", timeout=300)
    assert_refused(result, (
        "ValueError: 4 sequences do not split evenly over 3 ranks; "
        "run on 2 ranks (the printed losses were checked there)"))
