"""copied_layers_fixed.py: nn.TransformerEncoder and nn.TransformerDecoder built with the
checker's fixes, or without zero.Init, train under ZeRO-3 like the model as written in one
process (every step's loss and full gradients), on 2 and on 4 ranks; under DeepSpeed's
default persistence threshold the model as written fails as under 0."""

import re

import pytest

from rankrun.pages import output_file
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/zero3/copied_layers_fixed.py"
TRAINS = ("the checker's fixes", "built without zero.Init")


@pytest.mark.parametrize("world_size", [2, 4])
def test_fixed_models_train_like_one_process(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for rank in range(world_size):
        runs = result.returned(rank)
        assert set(runs) == {"encoder", "decoder"}
        for kind, by_case in runs.items():
            want = by_case["one process"]
            for case in TRAINS:
                assert_matches(by_case[case]["losses"], want["losses"], f"{kind}, {case}")
                assert_matches(by_case[case]["grads"], want["grads"], f"{kind}, {case}")
            # DeepSpeed's default threshold (1e5) does not keep zero.Init from partitioning
            # the layer, so its copies are as empty as under 0.
            default = by_case["default persistence threshold"]
            assert default["step"] == 0 and "'ds_numel': 0" in default["error"], default
            assert re.match(r"AssertionError: \{'id': \d+, 'status': 'NOT_AVAILABLE'",
                            default["error"])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
