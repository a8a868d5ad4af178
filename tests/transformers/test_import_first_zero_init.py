"""snippets/transformers/import_first_zero_init.py (Fix 1: torch._dynamo imported before
zero.Init): the GPT-2 is built partitioned and trains under ZeRO-3 on 2 and 4 ranks like the same model in one process.

The 2-rank run uses new interpreters (fresh=True), as the failing example's does: in the warm
pool torch._dynamo is imported before the snippet starts, so there the fix would not be what made
the build work. The 4-rank run is made in the warm pool: what 4 ranks add over 2 is each weight
split four ways and each rank's share of the batches, which no first import changes; a fresh
4-rank run (about 40 s of CPU on 2 cores) would show the fix working again, as the 2-rank one does."""

import pytest

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace, train_causal_lm_in_one_process
from rankrun.results import assert_refused
from rankrun.runner import run_snippet

SNIPPET = "snippets/transformers/import_first_zero_init.py"
SHARED = "snippets/transformers/import_inside_zero_init.py"
TIMEOUT = 600  # importing Transformers in new interpreters, on a loaded 2-core machine


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_fix_trains_like_one_process(world_size, expect_output):
    import transformers

    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT, fresh=world_size == 2).check()
    example = example_namespace(SHARED)
    initial = result.returned(0)["initial"]
    model = transformers.GPT2LMHeadModel(example["tiny_gpt2_config"]())
    batches = [example["make_batch"](step) for step in range(example["STEPS"])]
    reference = train_causal_lm_in_one_process(model, initial, batches, example["LR"])
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["shape"] == (0,), got["shape"]  # built partitioned by zero.Init
        assert got["initial"].keys() == initial.keys()
        # Transformers did not initialize the weights: built under a zero.Init of the reader's,
        # the embeddings keep torch's nn.Embedding initialization, N(0, 1), and not GPT-2's
        # N(0, initializer_range = 0.02).
        assert abs(initial["transformer.wte.weight"].std().item() - 1.0) < 0.2
        assert_same_training(got, reference, f"rank {rank}")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: train(), shared with hf_config_zero_init.py, says so instead."""
    result = run_snippet(SNIPPET, 3, call="main", timeout=TIMEOUT)
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
