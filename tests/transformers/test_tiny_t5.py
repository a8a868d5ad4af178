"""snippets/transformers/tiny_t5.py: from_pretrained under ZeRO-3 partitions T5's tied shared weight."""

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import run_snippet


TINY = "snippets/transformers/tiny_t5.py"
# Importing Transformers and starting Trainer take long on a loaded 2-core machine.
TIMEOUT = 600
SHARED_NAMES = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]


@marks.shapes
def test_from_pretrained_under_zero3_partitions_the_tied_shared_weight(expect_output):
    result = run_snippet(TINY, 2, call="main", timeout=TIMEOUT).check()
    for rank in range(2):
        facts = result.returned(rank)
        assert facts["zero3"] is True
        assert facts["shape"] == (0,) and facts["ds_shape"] == (32, 16)
        # T5 ties its embeddings and head: one Parameter under four names.
        assert facts["tied"] == SHARED_NAMES
    expect_output(result, output_file(TINY))
