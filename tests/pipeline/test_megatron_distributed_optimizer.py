"""snippets/pipeline/megatron_distributed_optimizer.py: Megatron Core's DistributedDataParallel
and finalize_model_grads on 2 stages x 2 replicas (and 1 replica). With an all-reduce over the
replicas, and with the distributed optimizer's reduce-scatter when the tied weight is marked
shared_embedding, each stage applies the one-process gradient; unmarked, the reduce-scatter
before the embedding all-reduce adds partial sums (Megatron-LM issue #844), exactly as that
report computes them, and the two stages apply different gradients."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/megatron_distributed_optimizer.py"
RIGHT = ("all-reduce over the replicas", "distributed optimizer, shared_embedding set")
UNMARKED = "distributed optimizer, shared_embedding not set"


def gradients_in_one_process(replicas):
    """The tied weight's gradient in one process over every replica's micro-batches (the
    mean), and each replica's two shares of it: the embedding's use (E) and the head's (H),
    each divided by the number of micro-batches, as a pipeline stage computes them."""
    ex = example_namespace(SNIPPET, with_siblings=["megatron_embedding_group"])
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    embed, head = model.embed.weight, model.head.weight
    assert embed is head
    shares = []
    for replica in range(replicas):
        use = {"E": torch.zeros_like(embed), "H": torch.zeros_like(embed)}
        for tokens, targets in ex["micro_batches"](replica):
            # The embedding's share: the head's weight held constant; the head's share:
            # the embedding's output held constant.
            as_input = model.embed(tokens)
            hidden = torch.tanh(model.mixer2(torch.tanh(model.mixer1(as_input))))
            loss = ex["cross_entropy"](hidden @ embed.detach().t(), targets)
            use["E"] += torch.autograd.grad(loss / ex["MICRO_BATCHES"], embed)[0]
            hidden = torch.tanh(model.mixer2(torch.tanh(model.mixer1(as_input.detach()))))
            loss = ex["cross_entropy"](hidden @ embed.t(), targets)
            use["H"] += torch.autograd.grad(loss / ex["MICRO_BATCHES"], embed)[0]
        shares.append(use)
    mean = sum(use["E"] + use["H"] for use in shares) / replicas
    return mean, shares


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_distributed_optimizer_needs_the_shared_embedding_mark(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=300).check()
    replicas = world_size // 2
    want, shares = gradients_in_one_process(replicas)
    got = result.returned(0)
    assert got["refused"] == "AssertionError: Torch not compiled with CUDA enabled"
    # stage-major: stage 0 on the first ranks, stage 1 on the rest.
    layout = [(rank // replicas, rank % replicas) for rank in range(world_size)]
    for name, every in got["results"].items():
        assert [(stage, replica) for stage, replica, _, _ in every] == layout
        applied = {stage: gradient for stage, replica, _, gradient in every if replica == 0}
        for stage, replica, _, gradient in every:
            # Every replica of a stage applies the same gradient.
            assert torch.equal(gradient, applied[stage]), (name, stage, replica)
        if name in RIGHT or replicas == 1:
            for stage in (0, 1):
                assert_matches(applied[stage], want, f"{name}, stage {stage}")
        else:
            # Megatron-LM #844's table: stage 0's replica 1 owns the whole embedding, stage 1's
            # replica 0 the whole head, and each adds the other stage's unreduced local share.
            owned = {(stage, replica): shard for stage, replica, shard, _ in every}
            assert owned == {(0, 0): None, (0, 1): (0, 128), (1, 0): (0, 128), (1, 1): None}
            mean_e = sum(use["E"] for use in shares) / replicas
            mean_h = sum(use["H"] for use in shares) / replicas
            assert_matches(applied[0], mean_e + shares[1]["H"] / replicas, f"{name}, stage 0")
            assert_matches(applied[1], mean_h + shares[0]["E"] / replicas, f"{name}, stage 1")
            for stage in (0, 1):
                assert not matches(applied[stage], want), (name, stage)
            assert not matches(applied[0], applied[1])
    if world_size == 4:
        # With the mark, both stages' replicas own the same halves of the weight.
        marked = got["results"]["distributed optimizer, shared_embedding set"]
        assert [shard for _, _, shard, _ in marked] == [(0, 64), (64, 128), (0, 64), (64, 128)]
        expect_output(result, output_file(SNIPPET))
