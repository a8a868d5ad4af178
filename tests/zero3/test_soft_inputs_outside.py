"""snippets/zero3/soft_inputs_outside.py: DeepSpeed issue #1047 as reported fails outside every forward."""

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import run_snippet


OUTSIDE = "snippets/zero3/soft_inputs_outside.py"


@marks.message
def test_soft_inputs_outside_forward_fails(expect_output):
    result = run_snippet(OUTSIDE, 2)
    assert not result.ok
    for rank in result.ranks:
        assert rank.exception is not None, rank.rank
        assert rank.exception["name"] == "RuntimeError"
        assert rank.exception["message"] == "mat2 must be a matrix"
        assert "compute_loss" in rank.exception["traceback"]
    expect_output(result, output_file(OUTSIDE))
