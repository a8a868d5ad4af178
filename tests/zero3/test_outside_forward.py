"""Accessing parameters outside forward: GatheredParameters, and the soft-input loss of DeepSpeed issue #1047
(fails outside forward; equals plain PyTorch when moved into a wrapper's forward); a change after
deepspeed.initialize; jobs on full weights; GatheredParameters in a loss; a shape read in a
constructor (DeepSpeed issue #907); the other GatheredParameters arguments."""

import re
import runpy

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import assert_same_training, train_in_one_process
from rankrun.runner import ROOT, run_snippet

GATHERED = "snippets/zero3/gathered_parameters.py"
OUTSIDE = "snippets/zero3/soft_inputs_outside.py"
WRAPPER = "snippets/zero3/soft_inputs_wrapper.py"
PAGE = ROOT / "docs/zero3/outside-forward.md"
GATHER_DEPRECATED = (
    "`torch.distributed.all_gather_into_tensor` is deprecated. "
    "Please use `torch.distributed.all_gather_single` instead."
)
GUARD = (
    "Detected in-place modification of ZeRO-3 parameters inside GatheredParameters with "
    "modifier_rank=None. Use modifier_rank=<rank> to broadcast updates across ranks."
)


def assert_grads_equal(got, want, label):
    assert got.keys() == want.keys(), label
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{label} {name}")


@pytest.fixture(scope="module")
def gathered_reference():
    example = runpy.run_path(str(ROOT / GATHERED), run_name="reference")
    torch.manual_seed(example["SEED"])
    model = example["LanguageModel"]()  # GatheredParameters is a no-op without ZeRO-3
    weight = model.embeddings.weight.detach().clone()
    tokens, targets = example["make_batch"]()
    loss = F.cross_entropy(model(tokens).reshape(-1, example["VOCAB"]), targets.reshape(-1))
    loss.backward()
    return weight, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathered_parameters(world_size, gathered_reference, expect_output):
    weight, want_loss, want_grads = gathered_reference
    result = run_snippet(GATHERED, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["outside"] == ((0,), (16, 8))  # empty outside forward; real shape in ds_shape
        # modifier_rank=0 in __init__: every rank holds the changed (halved) weight...
        torch.testing.assert_close(got["full"], weight, rtol=0, atol=0)
        assert got["after"] == (0,)  # ...and it is partitioned again after the with block
        # modifier_rank=None: the change is visible inside, then silently discarded.
        inside, after = got["lost"]
        assert inside == 0.0
        assert after == pytest.approx(weight.sum().item(), abs=1e-5)
        # ...and nothing warns about it: the only Python warning or log record (WARNING and
        # above) raised during the two blocks is torch's deprecation notice for the gather.
        assert got["lost_warnings"] and set(got["lost_warnings"]) == {GATHER_DEPRECATED}, got["lost_warnings"]
        # modifier_rank=0 keeps rank 0's change: each rank wrote its own rank number, and
        # afterwards every rank holds rank 0's value (0.0), partitioned again.
        assert got["broadcast"] == ([0.0], (0,))
        assert got["loss"] == pytest.approx(want_loss, abs=1e-6)
        assert_grads_equal(got["grads"], want_grads, f"rank {rank}")
        assert got["guard"] == GUARD
    if world_size == 2:
        expect_output(result, output_file(GATHERED))


def test_soft_inputs_outside_forward_fails(expect_output):
    result = run_snippet(OUTSIDE, 2)
    assert not result.ok
    for rank in result.ranks:
        assert rank.exception is not None, rank.rank
        assert rank.exception["name"] == "RuntimeError"
        assert rank.exception["message"] == "mat2 must be a matrix"
        assert "compute_loss" in rank.exception["traceback"]
    expect_output(result, output_file(OUTSIDE))


def train_wrapper_without_deepspeed():
    example = runpy.run_path(str(ROOT / WRAPPER), run_name="reference")
    torch.manual_seed(example["SEED"])
    vocab = example["VOCAB"]
    return train_in_one_process(
        example["SoftInputs"](example["Seq2Seq"]()),
        (example["make_batch"](step) for step in range(example["STEPS"])),
        lambda logits, targets: F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)),
        example["LR"],
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_soft_inputs_in_a_wrapper_forward_match_plain_pytorch(world_size, expect_output):
    reference = train_wrapper_without_deepspeed()
    result = run_snippet(WRAPPER, world_size, call="main").check()
    for rank in range(world_size):
        assert_same_training(result.returned(rank), reference, f"rank {rank}")
    if world_size == 2:
        expect_output(result, output_file(WRAPPER))


def test_page_shows_the_messages():
    page = PAGE.read_text()
    for message in ["mat2 must be a matrix", GUARD]:
        assert message in page, message
    # The one warning recorded while a change is lost is named where the pages say so.
    named = "`torch.distributed.all_gather_into_tensor` is deprecated"
    assert GATHER_DEPRECATED.startswith(named)
    for page_text in (page, (ROOT / "docs/zero3/troubleshooting.md").read_text()):
        assert named in page_text
    # Output excerpts typed on the page (```text blocks that are not includes) are lines of
    # the output files the runs wrote.
    printed = output_file(GATHERED).read_text().splitlines()
    blocks = re.findall(r"```text\n(.*?)```", page, flags=re.S)
    excerpts = [line for block in blocks if "--8<--" not in block for line in block.splitlines()]
    assert excerpts
    for line in excerpts:
        assert any(line in printed_line for printed_line in printed), line


CHANGE = "snippets/zero3/change_after_initialize.py"
JOBS = "snippets/zero3/full_weights_in_training.py"
IN_LOSS = "snippets/zero3/gathered_in_loss.py"
CONSTRUCTOR = "snippets/zero3/constructor_shape.py"
API = "snippets/zero3/gathered_parameters_api.py"
SIZE_ERROR = "IndexError: Dimension out of range (expected to be in range of [-1, 0], but got 1)"


def plain_change_losses():
    """The losses plain PyTorch computes for the same model and inputs at weights 0.5, 1.0, 3.0."""
    example = runpy.run_path(str(ROOT / CHANGE), run_name="reference")
    losses = {}
    for value in (0.5, 1.0, 3.0):
        torch.manual_seed(example["SEED"])
        model = torch.nn.Sequential(torch.nn.Linear(example["DIM"], example["DIM"]), torch.nn.Linear(example["DIM"], 1))
        with torch.no_grad():
            model[0].weight.fill_(value)
        losses[value] = round(model(torch.ones(example["BATCH"], example["DIM"])).square().mean().item(), 4)
    return losses


@pytest.mark.parametrize("world_size", [2, 4])
def test_change_after_initialize(world_size, expect_output):
    plain = plain_change_losses()
    result = run_snippet(CHANGE, world_size, call="main").check()
    for rank in range(world_size):
        for name, seen in result.returned(rank).items():
            label = f"rank {rank} {name}"
            # A change before deepspeed.initialize stays.
            assert seen["before initialize"] == [0.5], label
            assert seen["loss at 0.5"] == plain[0.5], label
            # GatheredParameters(modifier_rank=0) after initialize: the next forward computes
            # with the change, then engine.step() (lr=0.0) puts the old values back.
            assert seen["undone"] == ([1.0], plain[1.0], [0.5]), label
            # safe_set_full_fp32_param alone: the step computes with the old weight, then keeps the new one.
            assert seen["fp32"] == ([0.5], plain[0.5], [2.0]), label
            # Both: the step computes with the new weight and keeps it, in both copies.
            assert seen["both"] == ([3.0], plain[3.0], [3.0], [3.0]), label
        state_before, state_after, reset = result.returned(rank)["Adam"]["state"]
        assert state_before.abs().sum() > 0  # Adam has a state for this weight...
        torch.testing.assert_close(state_after, state_before, rtol=0, atol=0)  # ...that the change left as it was
        assert reset == [[0.0], [0.0]]  # safe_set_full_optimizer_state resets it
    if world_size == 2:
        expect_output(result, output_file(CHANGE))


def train_jobs_without_deepspeed():
    example = runpy.run_path(str(ROOT / JOBS), run_name="reference")
    torch.manual_seed(example["SEED"])
    model = example["build_model"]()
    optimizer = torch.optim.Adam(model.parameters(), lr=example["LR"])
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses, grads, norms = [], [], []
    for step in range(example["STEPS"]):
        if step == example["SURGERY_STEP"]:
            with torch.no_grad():
                model[0].weight[0] = 0.0
        inputs, targets = example["make_batch"](step)
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        grads.append(model[0].weight.grad.clone())
        optimizer.step()
        optimizer.zero_grad()
        norms.append(model[0].weight.norm().item())
        for name, param in model.named_parameters():
            ema[name].mul_(example["DECAY"]).add_(param.detach(), alpha=1 - example["DECAY"])
        losses.append(loss.item())
    return losses, grads, norms, ema


@pytest.mark.parametrize("world_size", [2, 4])
def test_jobs_on_full_weights_match_plain_pytorch(world_size, expect_output):
    losses, grads, norms, ema = train_jobs_without_deepspeed()
    result = run_snippet(JOBS, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["losses"] == pytest.approx(losses, abs=1e-6), rank
        assert got["norms"] == pytest.approx(norms, abs=1e-6), rank
        for step, (g, want) in enumerate(zip(got["grads"], grads)):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")
        assert got["ema"].keys() == ema.keys()
        for name in ema:
            torch.testing.assert_close(got["ema"][name], ema[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    if world_size == 2:
        expect_output(result, output_file(JOBS))


def train_in_loss_without_deepspeed(trainable):
    example = runpy.run_path(str(ROOT / IN_LOSS), run_name="reference")
    torch.manual_seed(example["SEED"])
    model = example["Seq2Seq"](True)
    model.shared.weight.requires_grad_(trainable)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=example["LR"])
    losses, grads = [], []
    for step in range(example["STEPS"]):
        sampled_input, targets = example["make_batch"](step)
        b, l, c = sampled_input.shape
        logits = model(sampled_input.reshape(b * l, c).mm(model.shared.weight).view(b, l, -1))
        loss = F.cross_entropy(logits.reshape(-1, example["VOCAB"]), targets.reshape(-1))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


ACCUMULATE_ERROR = "The size of tensor a (0) must match the size of tensor b (8) at non-singleton dimension 1"


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathered_parameters_in_a_loss(world_size, expect_output):
    trained = {True: train_in_loss_without_deepspeed(True), False: train_in_loss_without_deepspeed(False)}
    result = run_snippet(IN_LOSS, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        # Backward after the block: the trainable weight's gradient lands on the empty weight...
        assert got["trainable weight, data inputs"] == {"error": ACCUMULATE_ERROR}
        assert got["weight read only in the loss, data inputs"] == {"error": ACCUMULATE_ERROR}
        # ...and inputs that require grad need the weight's values: x.grad = grad @ weight.t().
        assert got["trainable weight, generator inputs"] == {"error": "mat2 must be a matrix"}
        assert got["frozen weight, generator inputs"] == {"error": "mat2 must be a matrix"}
        # Nothing of the weight needed in backward: trains as plain PyTorch does.
        assert_same_training(got["frozen weight, data inputs"], trained[False], f"rank {rank} frozen")
        # The backward inside the block: the weight is whole while autograd needs it.
        assert_same_training(got["backward inside the block, generator inputs"], trained[True], f"rank {rank} inside")
    if world_size == 2:
        expect_output(result, output_file(IN_LOSS))


@pytest.mark.parametrize("world_size", [2, 4])
def test_constructor_reads_a_shape(world_size, expect_output):
    example = runpy.run_path(str(ROOT / CONSTRUCTOR), run_name="reference")
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
            assert loss == pytest.approx(want, abs=1e-6), fix
    if world_size == 2:
        expect_output(result, output_file(CONSTRUCTOR))


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathered_parameters_api(world_size, expect_output):
    example = runpy.run_path(str(ROOT / API), run_name="reference")
    torch.manual_seed(example["SEED"])
    torch.nn.Linear(example["DIM"], 4)  # the same random draws as under zero.Init
    plain = example["ListHead"]()
    tokens, targets = example["make_batch"]()
    want = F.cross_entropy(plain(tokens).reshape(-1, example["VOCAB"]), targets.reshape(-1)).item()
    result = run_snippet(API, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["list"] == [(4, 8), (4,)]  # every parameter of the list gathered
        assert got["enabled=False"] == [(0,)]  # nothing gathered
        assert got["a module"] == [(0,)]  # a module is silently ignored
        # modifier_rank=None partitions on exit: empty again, storage freed.
        assert got["after modifier_rank=None"] == ((0,), "NOT_AVAILABLE", 0)
        # fwd_module=: the registration outlives the with block, and a later forward that
        # reads the weight through a list (not detected) computes the plain PyTorch loss.
        assert got["registered after the block"] == [True]
        assert got["loss"] == pytest.approx(want, abs=1e-6)
        assert got["exported"] is False  # not in deepspeed.zero, where the API doc puts it
        assert got["registered after unregister"] == []
    if world_size == 2:
        expect_output(result, output_file(API))
