"""Gradient clipping with a tied weight on 2 pipeline stages, against clip_grad_norm_ on the
same model in one process: DeepSpeed's norm (fp32, no ZeRO) is stage 0's gradients only; the
manual recipe matches one process only when the stages' squares are summed, the tie once."""

import math
import runpy

import pytest
import torch

from rankrun.pages import output_file
from rankrun.runner import ROOT, run_snippet

DEEPSPEED = "snippets/pipeline/deepspeed_tied_clip.py"
TORCH = "snippets/pipeline/torch_tied_clip.py"


def norm(tensors):
    return math.sqrt(sum((t.grad.double() ** 2).sum().item() for t in tensors))


def deepspeed_reference(rule):
    """One process: one embedding as input layer and head. rule "torch": clip_grad_norm_ on
    every parameter; rule "stage 0": the same scaling, by the norm of stage 0's parameters
    (embedding and first mixer) only. Returns losses, per-step norms (all, stage 0), weights."""
    ex = runpy.run_path(str(ROOT / DEEPSPEED), run_name="reference")
    torch.manual_seed(ex["SEED"] + 0)
    embedding = torch.nn.Embedding(ex["VOCAB"], ex["DIM"])
    torch.manual_seed(ex["SEED"] + 1)
    mixer1 = ex["Mixer"]()
    torch.manual_seed(ex["SEED"] + 2)
    mixer2 = ex["Mixer"]()
    params = [*embedding.parameters(), *mixer1.parameters(), *mixer2.parameters()]
    stage0 = [*embedding.parameters(), *mixer1.parameters()]
    optimizer = torch.optim.SGD(params, lr=ex["LR"])
    losses, norms = [], []
    for _ in range(ex["STEPS"]):
        total = 0.0
        for tokens, targets in ex["micro_batches"]("cpu"):
            logits = ex["logits_from_embedding"](embedding, mixer2(mixer1(embedding(tokens))))
            loss = ex["cross_entropy"](logits, targets)
            (loss / ex["MICRO_BATCHES"]).backward()
            total += loss.item()
        norms.append((norm(params), norm(stage0)))
        if rule == "torch":
            torch.nn.utils.clip_grad_norm_(params, ex["CLIP"])
        else:
            coefficient = min(1.0, ex["CLIP"] / (norms[-1][1] + 1e-6))  # DeepSpeed's formula
            for p in params:
                p.grad.mul_(coefficient)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / ex["MICRO_BATCHES"])
    weights = {"tied_modules.embed.weight": embedding.weight, "1.linear.weight": mixer1.linear.weight,
               "1.linear.bias": mixer1.linear.bias, "2.linear.weight": mixer2.linear.weight,
               "2.linear.bias": mixer2.linear.bias}
    return losses, norms, {k: v.detach().clone() for k, v in weights.items()}


def same_parameters(got, reference):
    return all(torch.allclose(value, reference[name], rtol=1e-5, atol=1e-6) for name, value in got.items())


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
        assert got["norms"][0]["whole model"] == pytest.approx(torch_norms[0][0], rel=1e-5)
        assert got["norms"][0]["deepspeed"] == pytest.approx(torch_norms[0][1], rel=1e-5)
        for step, n in enumerate(got["norms"]):
            assert n["deepspeed"] == pytest.approx(n["stage 0 only"], rel=1e-6)
            assert n["deepspeed"] == pytest.approx(stage0_norms[step][1], rel=1e-5)
            assert n["deepspeed"] < n["whole model"] * 0.9
        # Training: DeepSpeed equals the one-process model clipped by stage 0's norm, not the
        # one clipped by clip_grad_norm_.
        assert got["losses"] == pytest.approx(ds_losses, abs=1e-6)
        assert same_parameters(got["parameters"], stage0_weights)
        assert not same_parameters(got["parameters"], torch_weights)
        assert got["losses"][-1] != pytest.approx(torch_losses[-1], abs=1e-3)
    print(f"{DEEPSPEED}: {result.seconds:.1f} s on 2 ranks")
    expect_output(result, output_file(DEEPSPEED))


def torch_reference():
    ex = runpy.run_path(str(ROOT / TORCH), run_name="reference")
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    tokens, targets = ex["batch"]()
    losses, norms, shares = [], [], []
    for _ in range(ex["STEPS"]):
        total = 0.0
        for x, y in zip(tokens.tensor_split(ex["MICRO_BATCHES"]), targets.tensor_split(ex["MICRO_BATCHES"])):
            loss = ex["cross_entropy"](model(x), y)
            (loss / ex["MICRO_BATCHES"]).backward()
            total += loss.item()
        # What each stage sees of it when clipping alone: the tie (summed) plus its own mixer.
        shares.append((norm([model.embed.weight, *model.mixer1.parameters()]),
                       norm([model.embed.weight, *model.mixer2.parameters()])))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), ex["CLIP"]).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / ex["MICRO_BATCHES"])
    return losses, norms, shares, model


def test_manual_clipping_matches_one_process_only_with_the_whole_model_norm(expect_output):
    result = run_snippet(TORCH, 2, call="main", timeout=300).check()
    ref_losses, ref_norms, ref_stage_norms, model = torch_reference()
    for rank in range(2):
        whole, each = result.returned(rank)["whole model"], result.returned(rank)["each stage"]
        # Whole-model norm: both stages clip by clip_grad_norm_'s norm; training is one process's.
        assert [n0 for n0, _ in whole["norms"]] == pytest.approx(ref_norms, rel=1e-5)
        assert all(n0 == n1 for n0, n1 in whole["norms"])
        assert whole["losses"] == pytest.approx(ref_losses, abs=1e-6)
        assert whole["copies_equal"]
        torch.testing.assert_close(whole["weight"], model.embed.weight.detach(), rtol=1e-5, atol=1e-6)
        # Each stage alone: its norm counts the (summed) tied gradient and its own mixer only,
        # so the stages clip by different factors, the copies part, training differs.
        assert each["norms"][0] == pytest.approx(list(ref_stage_norms[0]), rel=1e-5)
        assert each["norms"][0][0] != pytest.approx(each["norms"][0][1], rel=1e-3)
        assert each["losses"][-1] != pytest.approx(ref_losses[-1], abs=1e-3)
        assert not each["copies_equal"]
    print(f"{TORCH}: {result.seconds:.1f} s on 2 ranks")
    expect_output(result, output_file(TORCH))
