"""snippets/zero3/zero3_checkpoint_resume.py: the tied model saved by zero3_checkpoint.py on 2
ranks, resumed on 4. load_checkpoint refuses another data-parallel size; ds_to_universal fails
on a checkpoint of plain SGD (no Adam moments); the consolidated fp32 weights loaded before
deepspeed.initialize resume exactly: the losses of the uninterrupted run and of one process."""

import pytest

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_checkpoint_example_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SAVING = "snippets/zero3/zero3_checkpoint.py"
SNIPPET = "snippets/zero3/zero3_checkpoint_resume.py"
# The saving run: the same arguments as its own test's, so it is one run.
TIMEOUT = 600
REFUSED = ("ZeRORuntimeException: The checkpoint being loaded used a DP world size of 2 but the "
           "current world size is 4. Automatic adjustment of ZeRO's optimizer state partitioning "
           "with a new world size is not currently supported.")


@pytest.fixture(scope="module")
def uninterrupted():
    """The 2-rank run that writes the checkpoint (the same run as its own test's), and the
    one-process reference."""
    saved = run_snippet(SAVING, 2, call="main", timeout=TIMEOUT).check()
    ex = example_namespace(SAVING)
    return ex, saved.returned(0)["tied"]["losses"], train_checkpoint_example_in_one_process(ex, "tied")[0]


def test_resume_on_four_ranks(uninterrupted, expect_output):
    ex, on_two_ranks, reference = uninterrupted
    result = run_snippet(SNIPPET, 4, call="main", timeout=TIMEOUT).check()
    after = ex["SAVED_AFTER"]
    for rank in range(4):
        got = result.returned(rank)
        assert got["as is errors"][0].startswith(REFUSED) and got["as is errors"][1].startswith(REFUSED)
        assert got["as is errors"][2].startswith("AssertionError")
        assert got["as is errors"][3].startswith("AssertionError")
        assert_matches(got["weights only"], on_two_ranks[after:], f"rank {rank} resumed")
        assert_matches(got["weights only"], reference[after:], f"rank {rank} against one process")
    assert result.returned(0)["universal"] == (1, "KeyError: 0")
    expect_output(result, output_file(SNIPPET))
