"""DeepSpeed refuses ZeRO-3 together with pipeline parallelism."""

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import run_snippet

SNIPPET = "snippets/pipeline/zero3_pipeline.py"


@marks.message
def test_pipeline_engine_rejects_zero3(expect_output):
    result = run_snippet(SNIPPET, 2)
    assert not result.ok
    message = "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
    assert result.errors == [f"AssertionError: {message}"]
    # Both ranks raise the same, from DeepSpeed's PipelineEngine (the page says "on every rank").
    raised = [rank.exception for rank in result.ranks if rank.exception]
    assert len(raised) == 2, [rank.cause() for rank in result.ranks]
    for exception in raised:
        assert (exception["name"], exception["message"]) == ("AssertionError", message)
        assert "deepspeed/runtime/pipe/engine.py" in exception["traceback"]
    expect_output(result, output_file(SNIPPET))
