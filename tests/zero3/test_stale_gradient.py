"""snippets/zero3/stale_gradient.py (trace_cache.py's model on more schedules) on 2 and 4 ranks.
A parameter that gets no gradient in a step is updated with its previous gradient again, with
or without "Invalidate trace cache": the head used on step 1 only gets its step-1 gradient in
steps 2 and 3, and the head called on every step without its bias on even steps (the module
order never changes, no message) gets step 1's bias gradient in step 2. With Adam, the head
called on every step with 0.0 * equals plain PyTorch making the same call, not plain PyTorch
skipping the head."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/zero3/stale_gradient.py"
EXAMPLE = example_namespace(SNIPPET, with_siblings=["trace_cache"])
SCHEDULES = EXAMPLE["SCHEDULES"]
AUX = ("aux.weight", "aux.bias")
# How often each schedule prints the message: once where the head is first used; never where
# the module order stays the same.
MESSAGES = {"step 1 only": 1, "odd steps, without its bias on the others": 0,
            "odd steps, always called, Adam": 0}


def train_in_one_process(schedule, skip_zero_calls=False):
    """Plain PyTorch: a parameter a step gives no gradient keeps .grad None, and the optimizer
    leaves it alone. skip_zero_calls: skip the head where the schedule calls it with 0.0 *."""
    aux_in, optimizer_name = SCHEDULES[schedule]
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["WithAuxiliaryHead"]()
    optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=EXAMPLE["LR"])
    losses, grads = [], []
    for step in range(EXAMPLE["STEPS"]):
        tokens = EXAMPLE["batch"](step)
        aux = "skipped" if skip_zero_calls and aux_in(step) == "zero" else aux_in(step)
        logits = model(tokens[:, :-1], aux=aux)
        loss = F.cross_entropy(logits.reshape(-1, EXAMPLE["VOCAB"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        grads.append({name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def assert_stale(got, plain, step, names, label):
    """In `step` ZeRO-3 reports for `names` exactly the previous step's (nonzero) gradient,
    where plain PyTorch has none."""
    for name in names:
        assert not plain[1][step][name].any(), f"{label}: plain PyTorch has a gradient for {name}"
        assert got["grads"][step - 1][name].any(), f"{label}: {name}"
        assert torch.equal(got["grads"][step][name], got["grads"][step - 1][name]), f"{label}: {name}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_parameter_without_gradient_gets_its_last_one(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    plain = {schedule: train_in_one_process(schedule) for schedule in SCHEDULES}
    adam_skipping = train_in_one_process("odd steps, always called, Adam", skip_zero_calls=True)
    for rank in range(world_size):
        got = result.returned(rank)
        label = f"rank {rank}"
        # Used on step 1 only: steps 0 and 1 are plain PyTorch's; the step-1 gradient comes
        # back in step 2 and again in step 3.
        once, plain_once = got["step 1 only"], plain["step 1 only"]
        assert_matches(once["losses"][:3], plain_once[0][:3], f"step 1 only, {label}")
        for step in (0, 1):
            assert_matches(once["grads"][step], plain_once[1][step], f"step 1 only, {label}, step {step}")
        for step in (2, 3):
            assert_stale(once, plain_once, step, AUX, f"step 1 only, {label}, step {step}")
        # Called on every step, without its bias on even steps: aux.weight's gradients are
        # plain PyTorch's, aux.bias gets step 1's again in step 2, and step 3 differs.
        no_bias, plain_no_bias = got["odd steps, without its bias on the others"], plain["odd steps, without its bias on the others"]
        assert_matches(no_bias["losses"][:3], plain_no_bias[0][:3], f"no bias, {label}")
        for step in range(3):
            assert_matches(no_bias["grads"][step]["aux.weight"], plain_no_bias[1][step]["aux.weight"],
                           f"no bias, {label}, step {step}")
        assert_stale(no_bias, plain_no_bias, 2, ("aux.bias",), f"no bias, {label}")
        assert not matches(no_bias["losses"][3:], plain_no_bias[0][3:])
        # 0.0 * with Adam: plain PyTorch's numbers for the same call, not for skipping the head.
        adam = got["odd steps, always called, Adam"]
        assert_same_training(adam, plain["odd steps, always called, Adam"], f"Adam, {label}")
        assert not matches(adam["losses"][3:], adam_skipping[0][3:])
    stdout = result.ranks[0].stdout
    parts = stdout.split("auxiliary head on ")
    assert [part.split(":")[0] for part in parts[1:]] == list(MESSAGES)
    assert [part.count("Invalidate trace cache") for part in parts[1:]] == list(MESSAGES.values()), stdout
    assert all("Invalidate" not in rank.stdout for rank in result.ranks[1:])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
