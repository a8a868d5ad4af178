"""snippets/pipeline/hf_pipeline_loader.py: a pipeline of LayerSpecs whose head copies its weight
from the file under lm_head.weight fails on the last stage, on 2 and 4 ranks, with the reader's
KeyError, because a tied checkpoint saved by save_pretrained stores the weight once (the test
of hf_pipeline_loader_tied.py checks the file's keys)."""

import pytest

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import run_snippet

SNIPPET = "snippets/pipeline/hf_pipeline_loader.py"


@marks.message
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_head_asks_the_tied_file_for_lm_head_weight(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size)
    assert not result.ok
    assert result.errors == ["KeyError: 'lm_head.weight'"]
    # Raised by the last stage only, building its head: the loader's lookup by the HF name.
    raised = {rank.rank: rank.exception for rank in result.ranks if rank.exception
              and rank.exception["name"] == "KeyError"}
    assert list(raised) == [world_size - 1], [rank.cause() for rank in result.ranks]
    traceback = raised[world_size - 1]["traceback"]
    assert 'load_from_hf(self, "lm_head.", folder)' in traceback, traceback
    assert "weights[prefix + name]" in traceback, traceback
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
