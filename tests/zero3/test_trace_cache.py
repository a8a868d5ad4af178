"""snippets/zero3/trace_cache.py on 2 and 4 ranks. An auxiliary head used on some steps only
makes DeepSpeed print "Invalidate trace cache" (with log_trace_cache_warnings on). A parameter
that gets no gradient in a step is updated with its previous gradient again, with or without
the message: the head skipped on even steps, the head used on step 1 only (its step-1
gradient comes back in every later step), and the head called on every step without its bias
on even steps (the same module order, no message). The head called on every step with a zero
contribution trains like plain PyTorch skipping it with SGD; with Adam it equals plain PyTorch
making the same zero call, not plain PyTorch skipping the head."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/zero3/trace_cache.py"
EXAMPLE = example_namespace(SNIPPET)
INVALIDATE = "Invalidate trace cache @ step 3: expected module 3, but got module 6"
AUX = ("aux.weight", "aux.bias")
# How often each schedule prints the message: at the head's first use after a step without
# it, and (step 1 only) nowhere else; never where the module order stays the same.
MESSAGES = {"every step": 0, "odd steps": 2, "step 1 only": 1,
            "odd steps, without its bias on the others": 0,
            "odd steps, always called": 0, "odd steps, always called, Adam": 0}


def train_in_one_process(schedule, skip_zero_calls=False):
    """Plain PyTorch: a parameter a step gives no gradient keeps .grad None, and the optimizer
    leaves it alone. skip_zero_calls: skip the head where the schedule calls it with 0.0 *."""
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["WithAuxiliaryHead"]()
    optimizer = EXAMPLE["make_optimizer"](schedule, model.parameters())
    losses, grads = [], []
    for step in range(EXAMPLE["STEPS"]):
        tokens = EXAMPLE["batch"](step)
        aux = EXAMPLE["aux_mode"](schedule, step)
        if skip_zero_calls and aux == "zero":
            aux = "skipped"
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
    """In `step` ZeRO-3 reports for `names` exactly the previous step's gradient, where plain
    PyTorch has none."""
    for name in names:
        assert not plain[1][step][name].any(), f"{label}: plain PyTorch has a gradient for {name}"
        assert torch.equal(got["grads"][step][name], got["grads"][step - 1][name]), f"{label}: {name}"
        assert got["grads"][step][name].any(), f"{label}: {name}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_parameter_without_gradient_in_a_step(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    plain = {schedule: train_in_one_process(schedule) for schedule in EXAMPLE["SCHEDULES"]}
    adam_skipping = train_in_one_process("odd steps, always called, Adam", skip_zero_calls=True)
    for rank in range(world_size):
        got = result.returned(rank)
        label = f"rank {rank}"
        assert_same_training(got["every step"], plain["every step"], f"every step, {label}")
        # Skipped on even steps: steps 0 to 2 have plain PyTorch's losses and steps 0 and 1
        # its gradients; step 2 reports (and applies) step 1's gradient for the head again.
        skipped = got["odd steps"]
        assert_matches(skipped["losses"][:3], plain["odd steps"][0][:3], f"odd steps, {label}")
        for step in (0, 1):
            assert_matches(skipped["grads"][step], plain["odd steps"][1][step], f"odd steps, {label}, step {step}")
        assert_stale(skipped, plain["odd steps"], 2, AUX, f"odd steps, {label}")
        assert not matches(skipped["losses"][3:], plain["odd steps"][0][3:])
        # Used on step 1 only: its step-1 gradient comes back in step 2 and again in step 3.
        once = got["step 1 only"]
        for step in (2, 3):
            assert_stale(once, plain["step 1 only"], step, AUX, f"step 1 only, {label}, step {step}")
        # Called on every step, without its bias on even steps: the module order never
        # changes, and aux.bias still gets step 1's gradient in step 2.
        no_bias = got["odd steps, without its bias on the others"]
        plain_no_bias = plain["odd steps, without its bias on the others"]
        assert_matches(no_bias["losses"][:3], plain_no_bias[0][:3], f"no bias, {label}")
        assert_matches(no_bias["grads"][2]["aux.weight"], plain_no_bias[1][2]["aux.weight"], f"no bias, {label}")
        assert_stale(no_bias, plain_no_bias, 2, ("aux.bias",), f"no bias, {label}")
        assert not matches(no_bias["losses"][3:], plain_no_bias[0][3:])
        # Called on every step with 0.0 *: plain PyTorch's numbers. With SGD that is also
        # plain PyTorch skipping the head (a zero gradient moves nothing); with Adam it is not.
        assert_same_training(got["odd steps, always called"], plain["odd steps"], f"always called, {label}")
        adam = got["odd steps, always called, Adam"]
        assert_same_training(adam, plain["odd steps, always called, Adam"], f"Adam, {label}")
        assert not matches(adam["losses"][3:], adam_skipping[0][3:])
    stdout = result.ranks[0].stdout
    parts = stdout.split("auxiliary head on ")
    assert [part.split(":")[0] for part in parts[1:]] == list(EXAMPLE["SCHEDULES"])
    counts = [part.count("Invalidate trace cache") for part in parts[1:]]
    # Printed on rank 0 only, at each step whose module order differs from the recorded one.
    assert counts == list(MESSAGES.values()) and parts[2].count(INVALIDATE) == 2, stdout
    assert all("Invalidate" not in rank.stdout for rank in result.ranks[1:])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 4 samples split 2/1/1 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 4 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
