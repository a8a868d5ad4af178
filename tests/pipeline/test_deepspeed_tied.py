"""DeepSpeed TiedLayerSpec on 2 pipeline stages equals the same model trained in one process;
the same layers declared with plain LayerSpec drift apart."""

import runpy

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import backward_over_micro_batches, layers_seeded_like_deepspeed
from rankrun.runner import ROOT, run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/deepspeed_tied.py"


def train_in_one_process():
    """The snippet's layers, data, micro-batching and optimizer in one plain-PyTorch process,
    with one embedding module serving as input layer and output head."""
    ex = runpy.run_path(str(ROOT / SNIPPET), run_name="reference")
    seed = ex["SEED"]
    # PipelineModule(seed_layers=True) builds layer i right after seeding with SEED + i.
    embedding, mixer1, mixer2 = layers_seeded_like_deepspeed(seed, {
        0: lambda: torch.nn.Embedding(ex["VOCAB"], ex["DIM"]), 1: ex["Mixer"], 2: ex["Mixer"]})
    params = [*embedding.parameters(), *mixer1.parameters(), *mixer2.parameters()]
    optimizer = torch.optim.SGD(params, lr=ex["LR"])
    losses = []
    for _ in range(ex["STEPS"]):
        losses.append(backward_over_micro_batches(ex["micro_batches"](), lambda tokens, targets: ex["cross_entropy"](
            ex["logits_from_embedding"](embedding, mixer2(mixer1(embedding(tokens)))), targets)))
        optimizer.step()
        optimizer.zero_grad()
    return losses, embedding.weight.detach().clone()


@pytest.fixture(scope="module")
def reference():
    return train_in_one_process()


def test_tied_layers_match_one_process_and_untied_copies_diverge(reference, expect_output):
    result = run_snippet(SNIPPET, 2, call="main").check()
    ref_losses, ref_weight = reference
    for rank in range(2):
        tied = result.returned(rank)["tied"]
        # Same losses as the one-process model (train_batch returns them on every stage).
        assert_matches(tied["losses"], ref_losses, "tied losses")
        # The copies are equal when built (DeepSpeed broadcasts from stage 0, although stage 1
        # built its copy from another seed) and after every step.
        assert tied["differences"] == [0.0] * (len(ref_losses) + 1)
        # Each stage's copy is the one-process embedding weight.
        assert_matches(tied["weight"], ref_weight)
        # Each stage holds a full copy; the tie's process group is the two stages' ranks.
        assert tied["weight"].shape == ref_weight.shape == (16, 8)
        assert tied["tie_ranks"] == [0, 1]

        untied = result.returned(rank)["untied"]
        # Without the tie nobody broadcasts: the stages build different weights.
        assert untied["differences"][0] > 1.0
        # Even from the same start (the snippet broadcasts by hand), each copy gets only its
        # own stage's gradient, so they drift apart from the first step on.
        assert all(diff > 1e-3 for diff in untied["differences"][1:]), untied["differences"]
        assert untied["differences"][1:] == sorted(untied["differences"][1:])  # and the gap grows
        # The first step's loss is the same (same weights); later ones are not.
        assert_matches(untied["losses"][0], ref_losses[0], "untied losses 0")
        assert not matches(untied["losses"][-1], ref_losses[-1])
        assert not matches(untied["weight"], ref_weight)
    # Both ranks report the same numbers.
    assert result.returned(0)["untied"]["differences"] == result.returned(1)["untied"]["differences"]
    expect_output(result, output_file(SNIPPET))


def test_tied_gradients_are_reduced_after_the_backward_passes_and_before_the_step():
    """The order the page states, read from DeepSpeed's own training schedule."""
    from deepspeed.runtime.pipe import schedule

    for stage in range(2):
        steps = [type(cmd).__name__ for cmds in schedule.TrainSchedule(micro_batches=2, stages=2, stage_id=stage)
                 for cmd in cmds]
        last_backward = max(i for i, name in enumerate(steps) if name == "BackwardPass")
        assert steps.count("ReduceTiedGrads") == 1
        assert last_backward < steps.index("ReduceTiedGrads") < steps.index("OptimizerStep")


def test_deepspeed_clips_gradients_at_1_by_default():
    from deepspeed.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig({"train_batch_size": 1}).gradient_clipping == 1.0
