"""snippets/pipeline/deepspeed_tied_clip.py: gradient clipping with a tied weight on 2 DeepSpeed stages,
against clip_grad_norm_ on the same model in one process: DeepSpeed's norm (fp32, no ZeRO) is
stage 0's gradients only."""

import torch

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import backward_over_micro_batches, example_namespace, gradient_norm, layers_seeded_like_deepspeed
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches


DEEPSPEED = "snippets/pipeline/deepspeed_tied_clip.py"


def deepspeed_reference(rule):
    """One process: one embedding as input layer and head. rule "torch": clip_grad_norm_ on
    every parameter; rule "stage 0": the same scaling, by the norm of stage 0's parameters
    (embedding and first mixer) only. Returns losses, per-step norms (all, stage 0), weights."""
    ex = example_namespace(DEEPSPEED)
    embedding, mixer1, mixer2 = layers_seeded_like_deepspeed(ex["SEED"], {
        0: lambda: torch.nn.Embedding(ex["VOCAB"], ex["DIM"]), 1: ex["Mixer"], 2: ex["Mixer"]})
    params = [*embedding.parameters(), *mixer1.parameters(), *mixer2.parameters()]
    stage0 = [*embedding.parameters(), *mixer1.parameters()]
    optimizer = torch.optim.SGD(params, lr=ex["LR"])
    losses, norms = [], []
    for _ in range(ex["STEPS"]):
        losses.append(backward_over_micro_batches(ex["micro_batches"]("cpu"), lambda tokens, targets: ex["cross_entropy"](
            ex["logits_from_embedding"](embedding, mixer2(mixer1(embedding(tokens)))), targets)))
        norms.append((gradient_norm(params), gradient_norm(stage0)))
        if rule == "torch":
            torch.nn.utils.clip_grad_norm_(params, ex["CLIP"])
        else:
            coefficient = min(1.0, ex["CLIP"] / (norms[-1][1] + 1e-6))  # DeepSpeed's formula
            for p in params:
                p.grad.mul_(coefficient)
        optimizer.step()
        optimizer.zero_grad()
    weights = {"tied_modules.embed.weight": embedding.weight, "1.linear.weight": mixer1.linear.weight,
               "1.linear.bias": mixer1.linear.bias, "2.linear.weight": mixer2.linear.weight,
               "2.linear.bias": mixer2.linear.bias}
    return losses, norms, {k: v.detach().clone() for k, v in weights.items()}


def same_parameters(got, reference):
    return all(matches(value, reference[name]) for name, value in got.items())


def test_deepspeed_clips_by_the_norm_of_stage_0_only(expect_output):
    result = run_snippet(DEEPSPEED, 2, call="main", timeout=300).check()
    torch_losses, torch_norms, torch_weights = deepspeed_reference("torch")
    ds_losses, stage0_norms, stage0_weights = deepspeed_reference("stage 0")
    for rank in range(2):
        got = result.returned(rank)
        # Clipping was active at every step (the norms are above CLIP).
        assert all(n["deepspeed"] > 0.1 for n in got["norms"])
        # What the snippet measured before clipping, at the first step (same weights in every run):
        # the whole model's norm is clip_grad_norm_'s in one process; DeepSpeed's is stage 0's.
        assert_matches(got["norms"][0]["whole model"], torch_norms[0][0], "norms 0 whole model")
        assert_matches(got["norms"][0]["deepspeed"], torch_norms[0][1], "norms 0 deepspeed")
        for step, n in enumerate(got["norms"]):
            assert_matches(n["deepspeed"], n["stage 0 only"], "n deepspeed")
            assert_matches(n["deepspeed"], stage0_norms[step][1], "n deepspeed")
            assert n["deepspeed"] < n["whole model"] * 0.9
        # Training: DeepSpeed equals the one-process model clipped by stage 0's norm, not the
        # one clipped by clip_grad_norm_.
        assert_matches(got["losses"], ds_losses, "losses")
        assert same_parameters(got["parameters"], stage0_weights)
        assert not same_parameters(got["parameters"], torch_weights)
        assert not matches(got["losses"][-1], torch_losses[-1])
    print(f"{DEEPSPEED}: {result.seconds:.1f} s on 2 ranks")
    expect_output(result, output_file(DEEPSPEED))


@marks.refusal
def test_a_rank_count_other_than_one_per_stage_is_refused():
    """On 4 ranks DeepSpeed makes two replicas of the 2 stages; the whole-model norm, summed
    over every rank, would count each stage twice. The example says so instead."""
    result = run_snippet(DEEPSPEED, 4, call="main", timeout=300)
    assert_refused(result, (
        "ValueError: the norms would count each stage once per replica on 4 "
        "ranks; run on 2 ranks, one per stage (the printed norms were checked there)"))
