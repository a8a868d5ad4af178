"""snippets/transformers/copied_reference.py: a reference model copied from the trained one
under ZeRO-3. TRL's create_reference_model refuses with its own message; copy.deepcopy before
deepspeed.initialize gives a model of empty weights without DeepSpeed's attributes, whose
forward fails; after it, the copy's forward fails and so does the trained model's own. The
reference loaded with from_pretrained in its own engine gives the one-process logits."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/copied_reference.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
EXAMPLE = example_namespace(SNIPPET)

TRL_REFUSES = ("ValueError: DeepSpeed ZeRO-3 is enabled and is not compatible with "
               "`create_reference_model()`. Please instantiate your reference model directly with "
               "`AutoModelForCausalLM.from_pretrained()`.")


@pytest.mark.parametrize("world_size", [2, 4])
def test_copies_fail_and_the_loaded_reference_equals_one_process(world_size, expect_output):
    model = EXAMPLE["tiny_llama"]().eval()
    with torch.no_grad():
        want = model(EXAMPLE["batch"]()).logits
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["create_reference_model"] == (TRL_REFUSES, "create_reference_model (utils.py)")
        assert got["copy: weight"] == ((0,), False)  # empty, and no longer a ZeRO-3 parameter
        assert got["copy: forward"] == ("RuntimeError: 'weight' must be 2-D", "embedding (functional.py)")
        assert got["copy after initialize: forward"][0] == (
            "AttributeError: 'Parameter' object has no attribute 'ds_status'")
        assert got["policy after the copy: forward"][0] == (
            "AttributeError: 'Parameter' object has no attribute 'ds_id'")
        assert_matches(got["loaded: logits"], want, f"rank {rank} logits")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
