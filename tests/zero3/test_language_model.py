"""LanguageModel under ZeRO-3 equals the same model trained without DeepSpeed."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from examples import output_file
from runner import DEEPSPEED_NOISE, ROOT, free_port, run_snippet

SNIPPET = "snippets/zero3/language_model.py"


def train_without_deepspeed():
    """The snippet's model, data and optimizer in one plain-PyTorch process."""
    example = runpy.run_path(str(ROOT / SNIPPET), run_name="reference")
    torch.manual_seed(example["SEED"])
    model = example["LanguageModel"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=example["LR"])
    losses, grads = [], []
    for step in range(example["STEPS"]):
        inputs, targets = example["make_batch"](step)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, example["VOCAB"]), targets.reshape(-1))
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
        assert len(got["grads"]) == len(expected_grads)
        for step, (grads, want) in enumerate(zip(got["grads"], expected_grads)):
            assert grads.keys() == want.keys()
            for name in want:
                assert grads[name].shape == want[name].shape, (step, name)
                torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
    expect_output(result, output_file(SNIPPET))


def test_documented_torchrun_command_prints_the_output_file():
    """The command on the page, run for real: torchrun, 2 CPU processes."""
    command = ["torchrun", "--nproc_per_node", "2", SNIPPET]
    assert " ".join(command) in (ROOT / "docs/zero3/external-parameters.md").read_text()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PET_MASTER_PORT": str(free_port())}
    # torchrun is installed next to the interpreter running the tests.
    command[0] = str(Path(sys.executable).parent / "torchrun")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = "".join(line + "\n" for line in done.stdout.splitlines() if not DEEPSPEED_NOISE.match(line))
    assert printed == output_file(SNIPPET).read_text()
