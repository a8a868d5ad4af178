"""Megatron Core's pipeline state on 2 CPU ranks over gloo: its embedding group is the first and
the last stage; GPTModel's start-up tie needs CUDA; its per-step all-reduce of the shared
weight's gradient (_allreduce_word_embedding_grads) makes the two copies train as one weight."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_gpipe_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/megatron_embedding_group.py"


@pytest.fixture(scope="module")
def reference():
    """The snippet's model in one process, one weight for both uses; GPipe micro-batching, SGD."""
    ex = example_namespace(SNIPPET)
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    start = model.embed.weight.detach().clone()
    losses, first_grad = train_gpipe_in_one_process(ex, model, model.embed.weight)
    return start, losses, first_grad, model.embed.weight.detach().clone()


def test_embedding_group_keeps_the_two_copies_one_weight(reference, expect_output):
    result = run_snippet(SNIPPET, 2, call="main").check()
    ref_start, ref_losses, ref_first_grad, ref_weight = reference
    for rank in range(2):
        got = result.returned(rank)
        # parallel_state's embedding group with pipeline_model_parallel_size=2: both stages.
        assert got["group_ranks"] == [0, 1]
        # GPTModel's own start-up tie moves the weight with .cuda(): no CUDA in this torch.
        assert got["startup_error"] == "AssertionError: Torch not compiled with CUDA enabled"
        # The last stage's copy started with values of its own; the first stage's are the
        # one-process model's.
        first_start, last_start = got["starts"]
        assert torch.equal(first_start, ref_start)
        assert not matches(last_start, ref_start)
        assert_matches(got["losses"], ref_losses, "losses")
        # Each stage's gradient is one use's share; the all-reduce gives both their sum, the
        # one-process gradient.
        share0, share1 = got["first_shares"]
        for share in (share0, share1):
            assert not matches(share, ref_first_grad)
        assert_matches(share0 + share1, ref_first_grad)
        assert_matches(got["first_summed"], ref_first_grad)
        # After the SGD steps the copies are bit-identical and equal the one-process weight.
        assert torch.equal(got["copies"][0], got["copies"][1])
        assert_matches(got["weight"], ref_weight)
    expect_output(result, output_file(SNIPPET))
