"""snippets/pipeline/pipeline_to_plain.py: the per-layer files of a tied 2-stage pipeline
checkpoint become one plain state dict with the tied weight once; the one-process model loaded
from it gives the pipeline's loss and the loss of the same training in one process (the
reference of deepspeed_tied_checkpoint's test). ds_to_universal finds no ZeRO files in a
pipeline checkpoint."""

import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_tied_pipeline_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches


SNIPPET = "snippets/pipeline/pipeline_to_plain.py"


def test_pipeline_checkpoint_to_one_plain_model(expect_output):
    ex = example_namespace(SNIPPET)
    reference, _ = train_tied_pipeline_in_one_process()  # the losses of the checkpoint test's reference
    result = run_snippet(SNIPPET, 2, call="main", timeout=300).check()
    got = result.returned(0)
    state_dict = got["state_dict"]
    assert sorted(state_dict) == ["embedding.weight", "mixers.0.linear.bias", "mixers.0.linear.weight",
                                  "mixers.1.linear.bias", "mixers.1.linear.weight"]
    model = ex["PlainModel"]()
    model.load_state_dict(state_dict)  # here, in the test process: strict
    with torch.no_grad():
        batches = list(ex["micro_batches"](ex["SAVED_AFTER"]))
        loss = sum(ex["cross_entropy"](model(x), y).item() for x, y in batches) / len(batches)
    after = ex["SAVED_AFTER"]
    for rank in range(2):
        assert_matches(result.returned(rank)["losses"], reference[:after], f"rank {rank} losses")
        assert_matches(result.returned(rank)["evaluated"], loss, f"rank {rank} pipeline loss")
    # Loaded after 2 steps, the plain model's loss is the one-process run's third step loss.
    assert_matches(loss, reference[after], "loaded model against one process")
    assert_matches(got["plain"], got["evaluated"], "the snippet's one-process loss")
    assert got["universal"] == (1, "FileNotFoundError: can't find *_optim_states.pt files in directory '<folder>'")
    expect_output(result, output_file(SNIPPET))
