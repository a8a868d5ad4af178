"""Each row of the automatic-detection table, checked against plain PyTorch on 2 and 4 ranks."""

import runpy

import pytest
import torch
import torch.nn.functional as F

from examples import output_file
from runner import ROOT, run_snippet

SNIPPET = "snippets/zero3/automatic_detection.py"
PAGE = ROOT / "docs/zero3/automatic-detection.md"

# Patterns that give the plain-PyTorch result without registration (and with it).
DETECTED = [
    "attribute read in a forward",
    "submodule returns its own parameter",
    "shared Parameter (tied head)",
    "engine.module(...) instead of engine(...)",
]
# Patterns that fail without registration and give the plain-PyTorch result with it.
NEEDS_REGISTRATION = {
    "reference kept in a list": "RuntimeError: size mismatch, got input (10), mat (10x8), vec (0)",
    "reference kept in a dict": "RuntimeError: 'weight' must be 2-D",
    "reference kept on a non-module object": "RuntimeError: mat2 must be a matrix",
}
# Patterns that fail with and without registration (no forward is running).
REGISTRATION_CANNOT_HELP = {
    "read outside any forward": "IndexError: Dimension out of range (expected to be in range of [-1, 0], but got 1)",
    "indexed in a constructor under zero.Init": "IndexError: index 0 is out of bounds for dimension 0 with size 0",
}
# Runs, but the change made in the constructor is lost: silently wrong.
SILENTLY_LOST = "changed in a constructor under zero.Init"


class PlainEngine:
    """Stands in for the DeepSpeed engine in the one-process reference: engine(x) and engine.module."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args):
        return self.module(*args)


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(ROOT / SNIPPET), run_name="reference")


def plain_pytorch(example, name):
    """The pattern's model, seed and batch, one forward and backward, no DeepSpeed."""
    pattern = example["PATTERNS"][name]
    torch.manual_seed(example["SEED"])
    model = pattern(False)
    tokens, targets = example["make_batch"]()
    logits = pattern.logits(PlainEngine(model), tokens)
    loss = F.cross_entropy(logits.reshape(-1, example["VOCAB"]), targets.reshape(-1))
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def assert_equal_runs(got, want, label):
    assert "error" not in got, f"{label}: {got.get('error')}"
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6), label
    assert got["grads"].keys() == want["grads"].keys(), label
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=f"{label} {name}")


def test_table_covers_every_pattern(example):
    expected = set(DETECTED) | set(NEEDS_REGISTRATION) | set(REGISTRATION_CANNOT_HELP) | {SILENTLY_LOST}
    assert set(example["PATTERNS"]) == expected


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_pattern_on_zero3(world_size, example, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for rank in range(world_size):
        rows = result.returned(rank)
        for name in DETECTED:
            want = plain_pytorch(example, name)
            for register in (False, True):
                assert_equal_runs(rows[name][register], want, f"rank {rank} {name} register={register}")
        for name, message in NEEDS_REGISTRATION.items():
            assert rows[name][False] == {"error": message}, (rank, name)
            assert_equal_runs(rows[name][True], plain_pytorch(example, name), f"rank {rank} {name} registered")
        for name, message in REGISTRATION_CANNOT_HELP.items():
            plain_pytorch(example, name)  # the same code works without ZeRO-3
            assert rows[name][False] == {"error": message}, (rank, name)
            assert rows[name][True] == {"error": message}, (rank, name)
        # The constructor's change is silently lost: the run equals the model *without* the
        # change, and differs from plain PyTorch with it.
        with_change = plain_pytorch(example, SILENTLY_LOST)
        without_change = plain_pytorch(example, "attribute read in a forward")
        assert with_change["loss"] != pytest.approx(without_change["loss"], abs=1e-3)
        for register in (False, True):
            got = rows[SILENTLY_LOST][register]
            assert_equal_runs(got, without_change, f"rank {rank} {SILENTLY_LOST} register={register}")
            assert got["loss"] != pytest.approx(with_change["loss"], abs=1e-3)
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


def test_page_shows_the_messages_the_run_printed():
    printed = output_file(SNIPPET).read_text()
    page = PAGE.read_text()
    for message in [*NEEDS_REGISTRATION.values(), *REGISTRATION_CANNOT_HELP.values()]:
        assert message in printed
        assert message.split(": ", 1)[1] in page, message
    assert "not deprecated" in page
