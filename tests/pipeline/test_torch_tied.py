"""torch.distributed.pipelining splits a tied model into per-stage copies and leaves the tie to
the user; with a broadcast and an all_reduce(SUM) over the holding stages it equals one process."""

import importlib

import pytest
import torch

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_gpipe_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/torch_tied.py"


def load():
    return example_namespace(SNIPPET)


def train_in_one_process():
    """The snippet's model, data, micro-batching (GPipe: mean over micro-batches) and SGD."""
    ex = load()
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    losses, first_grad = train_gpipe_in_one_process(ex, model, model.embed.weight)
    return losses, first_grad, model.embed.weight.detach().clone()


@pytest.fixture(scope="module")
def reference():
    return train_in_one_process()


def test_pipelining_with_a_manual_tie_matches_one_process(reference, expect_output):
    result = run_snippet(SNIPPET, 2, call="main").check()
    ref_losses, ref_first_grad, ref_weight = reference
    for rank in range(2):
        got = result.returned(rank)
        # pipelining found the shared weight and names one copy per stage.
        assert got["uses"] == {"submod_pp_0": "embed.weight", "submod_pp_1": "head.weight"}
        assert got["holders"] == [0, 1]
        assert_matches(got["losses"], ref_losses, "losses")
        # Each stage's gradient is only a share: neither is the tied gradient, their sum is.
        share0, share1 = got["first_shares"]
        assert_matches(share0 + share1, ref_first_grad)
        for share in (share0, share1):
            assert not matches(share, ref_first_grad)
        # With the all_reduce both copies stay equal and equal the one-process weight.
        assert torch.equal(got["copies"][0], got["copies"][1])
        assert_matches(got["weight"], ref_weight)
    # Stage 0 also keeps a head.weight its forward never uses (it gets no gradient).
    assert result.returned(0)["parameter_names"] == ["embed.weight", "mixer1.weight", "mixer1.bias", "head.weight"]
    assert result.returned(0)["unused_grads"] == ["head.weight"]
    assert result.returned(1)["unused_grads"] == []
    # pipelining's note about the shared weight (logged at INFO on stderr, by every rank).
    for rank in result.ranks:
        assert "Parameter head.weight used in multiple stages: {submod_pp_0: None, submod_pp_1: None}." in rank.stderr
    expect_output(result, output_file(SNIPPET))


@marks.api
def test_pipelining_deep_copies_the_tied_weight_per_stage():
    ex = load()
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    tokens, _ = ex["batch"]()
    pipe, uses, holders = ex["split"](model, tokens)
    copy0 = pipe.get_stage_module(0).get_parameter("embed.weight")
    copy1 = pipe.get_stage_module(1).get_parameter("head.weight")
    assert holders == [0, 1]
    assert copy0 is not copy1 and copy0.data_ptr() != copy1.data_ptr()
    assert model.embed.weight is not copy0 and model.embed.weight is not copy1
    assert torch.equal(copy0, copy1) and torch.equal(copy0, model.embed.weight)


@marks.api
def test_old_pipe_module_is_gone():
    with pytest.raises(ModuleNotFoundError) as raised:
        importlib.import_module("torch.distributed.pipeline.sync")
    # The exact message the page quotes.
    assert str(raised.value) == "No module named 'torch.distributed.pipeline'"
