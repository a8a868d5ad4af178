"""snippets/zero3/zero3_checkpoint.py: ZeRO-3 checkpoints of a tied model and of a model with a
registered external parameter, consolidated with get_fp32_state_dict_from_zero_checkpoint, with
the zero_to_fp32.py script in the checkpoint folder and with save_16bit_model, then loaded in
this one process without DeepSpeed: keys, the tie, the weights, the outputs and the next step,
all against the same models trained in one process."""

import pytest
import torch

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_checkpoint_example_in_one_process
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/zero3/zero3_checkpoint.py"
# Two trainings, two runs of the zero_to_fp32.py script (a new interpreter each) per launch.
TIMEOUT = 600
SHARED_MESSAGE = ("RuntimeError: Some tensors share memory, this will lead to duplicate memory on disk and "
                  "potential differences when loading them again: [{'embeddings.weight', 'head.weight'}]")


def example():
    return example_namespace(SNIPPET)


@pytest.fixture(scope="module")
def reference():
    ex = example()
    return ex, {name: train_checkpoint_example_in_one_process(ex, name) for name in ex["MODELS"]}


def reload_in_this_process(ex, name, state_dict):
    """Load the consolidated state dict into the plain model here, strictly; one SGD step."""
    model = ex["MODELS"][name]()
    model.load_state_dict(state_dict)  # strict: raises on a missing or unexpected key
    with torch.no_grad():
        logits = model(ex["make_batch"](ex["SAVED_AFTER"])[0])
    inputs, targets = ex["make_batch"](ex["SAVED_AFTER"])
    loss = ex["loss_of"](model(inputs), targets)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=ex["LR"]).step()
    return model, logits, loss.item()


@pytest.mark.parametrize("world_size", [2, 4])
def test_checkpoints_reload_in_one_process(world_size, reference, expect_output):
    ex, trained = reference
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    saved_after = ex["SAVED_AFTER"]
    for name, keys in [("tied", ["embeddings.weight", "head.weight", "mixer.bias", "mixer.weight"]),
                       ("external", ["embeddings.weight", "mixer.bias", "mixer.weight"])]:
        ref_losses, ref_weights = trained[name]
        for rank in range(world_size):
            got = result.returned(rank)[name]
            assert_matches(got["losses"], ref_losses, f"{name} rank {rank} losses")
            # What the run held when it saved: every name, the tied one too.
            assert_matches(got["saved_weights"], ref_weights[saved_after], f"{name} rank {rank} weights")
        got = result.returned(0)[name]
        state_dict = got["state_dict"]
        assert sorted(state_dict) == keys
        assert_matches(state_dict, ref_weights[saved_after], f"{name} consolidated")
        script = got["scripts"]["default"]
        assert script["code"] == 0 and script["files"] == ["pytorch_model.bin"]
        assert_matches(script["state_dict"], ref_weights[saved_after], f"{name} zero_to_fp32.py")
        assert_matches(got["sixteen_bit"], ref_weights[saved_after], f"{name} save_16bit_model")
        assert {t.dtype for t in got["sixteen_bit"].values()} == {torch.float32}
        safe = got["scripts"]["--safe_serialization"]
        if name == "tied":
            # Stored once, restored to both names: one storage in every consolidated form.
            assert got["shared_in_state_dict"] == [["embeddings.weight", "head.weight"]]
            assert state_dict["head.weight"] is state_dict["embeddings.weight"]
            assert script["state_dict"]["head.weight"].data_ptr() == script["state_dict"]["embeddings.weight"].data_ptr()
            assert got["sixteen_bit"]["head.weight"].data_ptr() == got["sixteen_bit"]["embeddings.weight"].data_ptr()
            # The script's safetensors output refuses the shared storage.
            assert safe["code"] == 1 and safe["message"].startswith(SHARED_MESSAGE)
            assert not [f for f in safe["files"] if f.endswith((".safetensors", ".bin"))]
        else:
            assert got["shared_in_state_dict"] == []
            assert safe["code"] == 0 and safe["files"] == ["model.safetensors"]
        # Loaded here without DeepSpeed: the tie is the model's, the outputs are the run's,
        # and the next step is the step the ZeRO-3 run took.
        model, logits, loss = reload_in_this_process(ex, name, state_dict)
        if name == "tied":
            assert model.head.weight is model.embeddings.weight
        assert_matches(logits, got["logits"], f"{name} logits")
        assert_matches(loss, got["losses"][saved_after], f"{name} next step loss")
        assert_matches(model.state_dict(), ref_weights[saved_after + 1], f"{name} weights after the next step")
        assert got["reloaded"]["tied"] is (name == "tied")
        assert_matches(got["reloaded"]["loss"], ref_losses[saved_after], f"{name} snippet's next step")
    for rank in range(world_size):
        assert result.returned(rank)["gather_off"] == {"returned": False, "exists": False}
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main", timeout=TIMEOUT)
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
