"""snippets/transformers/t5_reader.py: the use case of DeepSpeed issue #1047 (a loss that reads
the embedding weight), with the real Trainer: the reader's compute_loss and registration attempts
fail, with their messages."""

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import run_snippet


READER = "snippets/transformers/t5_reader.py"
READER_INDEX_ERROR = "Dimension out of range (expected to be in range of [-1, 0], but got 1)"
CONSTRUCTOR_ERROR = (
    "Model is designed to be instantiated using the `Model.from_pretrained(pretrained_model_name_or_path)` "
    "or `Model.from_config(config)` methods."
)
MM_LINE = "sampled_input_embed = sampled_input.view(b * l, c).mm(model.module.shared.weight)"
# The reader's statement, wrapped to fit the page's column: the traceback shows the line it failed on.
TRANSPOSE_LINE = "model.module.shared.weight.transpose(0, 1))"
# Importing Transformers and starting Trainer take long on a loaded 2-core machine.
TIMEOUT = 600


@marks.message
def test_the_readers_attempts_fail(expect_output):
    result = run_snippet(READER, 2, call="main", timeout=TIMEOUT).check()
    for rank in range(2):
        got = result.returned(rank)
        # AutoModelForSeq2SeqLM subclass: from_pretrained and from_config build the concrete
        # class, so the subclass __init__ never runs; the constructor runs it and raises.
        assert got["auto"] == ["T5ForConditionalGeneration", "T5ForConditionalGeneration"]
        assert got["constructor"] == ("OSError", CONSTRUCTOR_ERROR, "super().__init__(self, *args)")
        # The reader's compute_loss: outside every forward the weight is empty.
        assert got["mm registered"] == [] and got["transpose registered"] == []
        assert got["mm"] == ("RuntimeError", "mat2 must be a matrix", MM_LINE)
        assert got["transpose"] == ("IndexError", READER_INDEX_ERROR, TRANSPOSE_LINE)
        # The concrete subclass's __init__ runs and registers the weight; the loss fails the same way.
        assert got["registered registered"] == [True]
        assert got["registered"] == ("RuntimeError", "mat2 must be a matrix", MM_LINE)
    expect_output(result, output_file(READER))
