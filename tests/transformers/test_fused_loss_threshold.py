"""snippets/transformers/fused_loss_threshold.py: under DeepSpeed's default
stage3_param_persistence_threshold and under 1e10 (the value of Liger-Kernel issue #1048), the
placements of the fused loss that fail at threshold 0 fail with the same messages; the placement
that trains gives the one-process losses and gradients at every threshold, and afterwards each
rank holds the whole model when every weight is under the threshold, none of it at 0."""

import pytest
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace, train_in_one_process
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun import marks

SNIPPET = "snippets/transformers/fused_loss_threshold.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
EX = example_namespace(SNIPPET, with_siblings=["fused_loss"])
SIZE_MISMATCH = "RuntimeError: size mismatch, got input (4), mat (4x16), vec (0)"
ACCUMULATE = ("RuntimeError: The size of tensor a (0) must match the size of tensor b (16) "
              "at non-singleton dimension 1")
FAILS = {  # as on the page, at threshold 0 (tests/transformers/test_fused_loss.py)
    "weight passed from the training loop": SIZE_MISMATCH,
    "gathered in the loop, backward after the block": ACCUMULATE,
    "run as the engine's forward, after a call of the whole model": ACCUMULATE,
}


@pytest.fixture(scope="module")
def reference():
    """The same Llama and batches in one process with plain SGD, the loss unfused."""
    model = EX["tiny_llama"]()
    batches = [(EX["batch"](step),) * 2 for step in range(EX["STEPS"])]

    def unfused(hidden, tokens):
        return F.cross_entropy(model.lm_head(hidden), tokens[:, 1:].reshape(-1))
    return train_in_one_process(model, batches, unfused, EX["LR"])


def test_no_threshold_makes_a_failing_placement_train(reference, expect_output):
    result = run_snippet(SNIPPET, 2, call="main", timeout=TIMEOUT).check()
    for rank in range(2):
        got = result.returned(rank)
        assert set(got) == {(label, placement) for label in EX["THRESHOLDS"]
                            for placement in [*EX["FAILING"], EX["TRAINS"]]}
        assert set(EX["FAILING"]) == set(FAILS)
        for (label, placement), record in got.items():
            where = f"rank {rank}, {label}, {placement}"
            if placement in FAILS:
                assert record["error"] == FAILS[placement], (where, record["error"])
                assert record["losses"] == [], where
                continue
            assert record["error"] is None, where
            assert_same_training(record, reference, where)
            # Every weight of this model is under DeepSpeed's default threshold: persistent,
            # it stays whole on every rank once gathered; at 0 nothing stays whole.
            held = 0 if label == "threshold 0" else record["elements"]
            assert record["held"] == held, where
    expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main", timeout=TIMEOUT)
    assert_refused(result, (
        "ValueError: 4 sequences do not split evenly over 3 ranks; "
        "run on 2 ranks (the printed losses were checked there)"))
