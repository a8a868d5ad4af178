"""DeepSpeed TiedLayerSpec on 2 pipeline stages equals the same model trained in one process;
the same layers declared with plain LayerSpec drift apart."""

import functools

import pytest
import torch

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import backward_over_micro_batches, example_namespace, layers_seeded_like_deepspeed
from rankrun.runner import ROOT, run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/deepspeed_tied.py"


def train_in_one_process():
    """The snippet's layers, data, micro-batching and optimizer in one plain-PyTorch process,
    with one embedding module serving as input layer and output head."""
    ex = example_namespace(SNIPPET)
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


def example_lines(output):
    """What the example prints, without DeepSpeed's lines (the topology, the layers)."""
    mine = ("TiedLayerSpec", "LayerSpec (no tie)", "  max |", "  step ")
    return [line for line in output.splitlines() if line.startswith(mine)]


def test_on_4_ranks_two_replicas_of_each_stage_print_the_same_numbers(reference):
    """On 4 ranks DeepSpeed puts stage 0 on ranks 0 and 1 (two data-parallel replicas, the same
    micro-batches), so rank 1's copy is stage 0's: each copy is compared with rank 0's, and
    example's own lines are the ones it prints on 2 ranks (DeepSpeed's, which name the
    topology, are left out)."""
    result = run_snippet(SNIPPET, 4, call="main").check()
    assert example_lines(result.output) == example_lines(output_file(SNIPPET).read_text())
    ref_losses, _ = reference
    for rank in range(4):
        assert_matches(result.returned(rank)["tied"]["losses"], ref_losses, f"rank {rank}")
        assert result.returned(rank)["untied"]["differences"][0] > 1.0, rank


@marks.api
def test_tied_gradients_are_reduced_after_the_backward_passes_and_before_the_step():
    """The order the page states, read from DeepSpeed's own training schedule."""
    from deepspeed.runtime.pipe import schedule

    for stage in range(2):
        steps = [type(cmd).__name__ for cmds in schedule.TrainSchedule(micro_batches=2, stages=2, stage_id=stage)
                 for cmd in cmds]
        last_backward = max(i for i, name in enumerate(steps) if name == "BackwardPass")
        assert steps.count("ReduceTiedGrads") == 1
        assert last_backward < steps.index("ReduceTiedGrads") < steps.index("OptimizerStep")
        # The tie's sum over the stages comes before the data-parallel reduction.
        assert steps.index("ReduceTiedGrads") < steps.index("ReduceGrads")


@marks.api
def test_deepspeed_clips_gradients_at_1_by_default():
    from deepspeed.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig({"train_batch_size": 1}).gradient_clipping == 1.0


# What the older releases printed for this file (versions/matrix.json), explained: one process
# with the gradient scaled as each release's PipelineEngine scales it over the micro-batches.
SCALING = {
    # loss / micro-batches on the last stage, nothing more (0.14.5, and again from 0.19.3 on).
    "mean": ["0.14.5", "0.19.3", "0.19.8"],
    # no division at all: the loss is scaled only when enable_backward_allreduce is on, which
    # PipelineEngine turns off (from DeepSpeed #6675 until the backward API of #7665).
    "sum": ["0.16.5", "0.17.6"],
    # the output hook of #7665 divides on every stage (#7787 runs it on the earlier stages):
    # stage 0 divides a gradient stage 1 already divided (fixed by #8154, in 0.19.3).
    "stage 0 twice": ["0.18.9", "0.19.2"],
}
COMMAND = f"torchrun --nproc_per_node 2 {SNIPPET}"
PRINTED = r"step (\d): loss ([\d.]+), max \|stage 0 copy - stage 1 copy\| ([\d.]+)"


@functools.cache
def train_with_scaling(scaling, tied):
    """The snippet's model in one process, with `scaling` of the gradient (see SCALING). The
    untied variant: a second embedding for the head, a copy of the first at the start (the
    snippet broadcasts it by hand). Returns the step losses and max |embedding - head| after
    each step, as the snippet prints them."""
    ex = example_namespace(SNIPPET)
    embedding, mixer1, mixer2 = layers_seeded_like_deepspeed(ex["SEED"], {
        0: lambda: torch.nn.Embedding(ex["VOCAB"], ex["DIM"]), 1: ex["Mixer"], 2: ex["Mixer"]})
    head = embedding if tied else torch.nn.Embedding(ex["VOCAB"], ex["DIM"])
    head.weight.data.copy_(embedding.weight.data)
    params = {id(p): p for m in (embedding, mixer1, mixer2, head) for p in m.parameters()}
    optimizer = torch.optim.SGD(params.values(), lr=ex["LR"])
    n = ex["MICRO_BATCHES"]
    losses, differences = [], []
    for _ in range(ex["STEPS"]):
        total = 0.0
        for tokens, targets in ex["micro_batches"]():
            hidden = mixer1(embedding(tokens))  # what stage 0 sends to stage 1
            if scaling == "stage 0 twice":
                hidden.register_hook(lambda grad: grad / n)
            loss = ex["cross_entropy"](ex["logits_from_embedding"](head, mixer2(hidden)), targets)
            (loss if scaling == "sum" else loss / n).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / n)
        differences.append((embedding.weight - head.weight).abs().max().item())
    return losses, differences


def printed_by(release):
    """(tied, untied) step losses and differences the release's run printed."""
    import json
    import re

    data = json.loads((ROOT / "versions" / "matrix.json").read_text())
    run = data["releases"][release]["examples"][COMMAND]
    assert run["ok"], release
    tied, untied = run["printed"][0].split("LayerSpec (no tie)")
    parse = lambda text: [[float(v) for v in row[1:]] for row in re.findall(PRINTED, text)]
    return [list(map(list, zip(*parse(part)))) for part in (tied, untied)]


def agrees_with_print(printed, computed):
    """Equal to the 4 decimals printed: within half a unit of the last printed digit, plus the
    project's tolerance."""
    from rankrun.tolerance import eps, matches

    worst = max(abs(v) for v in computed) or 1.0
    return matches(printed, computed, ulps=64 + 0.5e-4 / (eps() * worst))


@pytest.mark.parametrize("scaling", list(SCALING))
def test_older_releases_train_with_another_gradient_scaling(scaling):
    """Each release's recorded losses and copy differences are reproduced, to the printed
    digits, by its scaling and by no other."""
    models = {name: {tied: train_with_scaling(name, tied) for tied in (True, False)} for name in SCALING}
    for release in SCALING[scaling]:
        for index, tied in enumerate((True, False)):
            losses, differences = printed_by(release)[index]
            for name, model in models.items():
                got = agrees_with_print(losses, model[tied][0]) and agrees_with_print(
                    differences, model[tied][1])
                assert got == (name == scaling), (release, tied, name, losses, model[tied])
