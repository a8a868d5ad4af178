"""snippets/zero3/gathered_parameters_api.py: the other GatheredParameters arguments (fwd_module, a list,
enabled, non-parameters) and unregister_external_parameter."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches


API = "snippets/zero3/gathered_parameters_api.py"


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathered_parameters_api(world_size, expect_output):
    example = example_namespace(API)
    torch.manual_seed(example["SEED"])
    torch.nn.Linear(example["DIM"], 4)  # the same random draws as under zero.Init
    plain = example["ListHead"]()
    tokens, targets = example["make_batch"]()
    want = F.cross_entropy(plain(tokens).reshape(-1, example["VOCAB"]), targets.reshape(-1)).item()
    result = run_snippet(API, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["list"] == [(4, 8), (4,)]  # every parameter of the list gathered
        assert got["enabled=False"] == [(0,)]  # nothing gathered
        assert got["a module"] == [(0,)]  # a module is silently ignored
        # modifier_rank=None partitions on exit: empty again, storage freed.
        assert got["after modifier_rank=None"] == ((0,), "NOT_AVAILABLE", 0)
        # fwd_module=: the registration outlives the with block, and a later forward that
        # reads the weight through a list (not detected) computes the plain PyTorch loss.
        assert got["registered after the block"] == [True]
        assert_matches(got["loss"], want, "loss")
        assert got["exported"] is False  # not in deepspeed.zero, where the API doc puts it
        assert got["registered after unregister"] == []
    if world_size == 2:
        expect_output(result, output_file(API))
