"""ModuleZ3 (the corrected upstream example) under ZeRO-3 equals plain PyTorch; the registered
weight is gathered at the start of ModuleZ3.forward and partitioned again after backward."""

import runpy

import pytest
import torch
import torch.nn.functional as F

from examples import output_file
from runner import ROOT, run_snippet

SNIPPET = "snippets/zero3/module_z3.py"


def train_without_deepspeed():
    example = runpy.run_path(str(ROOT / SNIPPET), run_name="reference")
    torch.manual_seed(example["SEED"])
    model = example["ModuleZ3"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=example["LR"])
    losses, grads = [], []
    for step in range(example["STEPS"]):
        inputs, targets = example["make_batch"](step)
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


@pytest.fixture(scope="module")
def reference():
    return train_without_deepspeed()


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_matches_plain_pytorch(world_size, reference, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    expected_losses, expected_grads = reference
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["losses"] == pytest.approx(expected_losses, abs=1e-6)
        for step, (grads, want) in enumerate(zip(got["grads"], expected_grads, strict=True)):
            assert grads.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
        # Outside forward the weight is empty; its real shape is in ds_shape.
        assert got["ds_shape"] == (8, 8)
        # What the page says DeepSpeed does with the registered weight.
        first, *later = got["watched"]
        assert first == [
            ("start of ModuleZ3.forward", (8, 8), "AVAILABLE"),
            ("end of ModuleZ3.forward", (0,), "NOT_AVAILABLE"),
            ("after engine.backward", (0,), "NOT_AVAILABLE"),
        ]
        assert later and all(
            steps == [
                ("start of ModuleZ3.forward", (8, 8), "AVAILABLE"),
                ("end of ModuleZ3.forward", (8, 8), "AVAILABLE"),
                ("after engine.backward", (0,), "NOT_AVAILABLE"),
            ]
            for steps in later
        ), later
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
