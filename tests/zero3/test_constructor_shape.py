"""snippets/zero3/constructor_shape.py: a shape read in a constructor under zero.Init (DeepSpeed issue #907)
and its fixes."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches


CONSTRUCTOR = "snippets/zero3/constructor_shape.py"
SIZE_ERROR = "IndexError: Dimension out of range (expected to be in range of [-1, 0], but got 1)"


@pytest.mark.parametrize("world_size", [2, 4])
def test_constructor_reads_a_shape(world_size, expect_output):
    example = example_namespace(CONSTRUCTOR)
    torch.manual_seed(example["SEED"])
    plain = example["LanguageModel"](example["width_from_config"])
    tokens, targets = example["make_batch"]()
    want = F.cross_entropy(plain(tokens).reshape(-1, example["VOCAB"]), targets.reshape(-1)).item()
    result = run_snippet(CONSTRUCTOR, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["width_from_size"] == SIZE_ERROR  # DeepSpeed issue #907's message
        for fix in ("width_from_ds_shape", "width_from_gathered", "width_from_config"):
            shape, loss = got[fix]
            assert shape == tuple(plain.head.weight.shape) == (16, 8), fix  # the head plain PyTorch builds
            assert_matches(loss, want, str(fix))
    if world_size == 2:
        expect_output(result, output_file(CONSTRUCTOR))
