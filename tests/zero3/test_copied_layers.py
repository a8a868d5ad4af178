"""copied_layers.py: torch's nn.TransformerEncoder built inside deepspeed.zero.Init has
layers that are plain Parameters of shape (0,) without a ds_id (copies of a partitioned
layer), and the first forward fails with ZeRO-3's AssertionError, on 2 and on 4 ranks."""

import re

import pytest

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import run_snippet

SNIPPET = "snippets/zero3/copied_layers.py"
# The parameter ZeRO-3 cannot gather: a copy, made a ZeRO-3 parameter by deepspeed.initialize
# from its empty data (ds_numel 0). Its ds_id and its module's id depend on the model.
MESSAGE = re.compile(
    r"\{'id': \d+, 'status': 'NOT_AVAILABLE', 'numel': 0, 'ds_numel': 0, 'shape': \(0,\), "
    r"'ds_shape': \(0,\), 'requires_grad': True, 'grad_shape': None, 'persist': True, "
    r"'active_sub_modules': \{\d+\}, 'ds_tensor.shape': torch.Size\(\[0\]\)\}")


@marks.message
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_copies_are_empty_and_the_first_forward_fails(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size)
    assert not result.ok
    messages = {rank.exception["message"] for rank in result.ranks}
    assert {rank.exception["name"] for rank in result.ranks} == {"AssertionError"}
    (message,) = messages  # the same parameter on every rank
    assert MESSAGE.fullmatch(message), message
    for rank in result.ranks:
        assert "_fetch_sub_module_impl" in rank.exception["traceback"]
        assert "loss_of(engine" in rank.exception["traceback"]
    # What zero.Init made: the embedding and the head are ZeRO-3 parameters (a ds_id, an
    # empty partition of their full shape); a layer's weight is a plain empty Parameter.
    printed = result.output.splitlines()
    assert printed[0].startswith("embed.weight: shape (0,), ds_id ")
    assert printed[0].endswith(", full shape (16, 8)")
    assert printed[1] == "encoder.layers.0.linear1.weight: shape (0,), no ds_id"
    assert printed[2].startswith("head.weight: shape (0,), ds_id ")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
