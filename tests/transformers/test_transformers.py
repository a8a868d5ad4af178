"""Hugging Face Transformers under ZeRO-3 (docs/zero3/transformers.md): DeepSpeed issue #1047 with
the real Trainer on a tiny T5, the reader's errors, and the fixes against plain PyTorch.

Each snippet runs all its cases in one launch (Transformers is slow to import); the one-process
reference is trained once for the module.
"""

import copy
import runpy
import shutil
import sys

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import assert_same_training
from rankrun.runner import ROOT, run_snippet

TINY = "snippets/transformers/tiny_t5.py"
READER = "snippets/transformers/t5_reader.py"
FIXES = "snippets/transformers/t5_fixes.py"
PAGE = ROOT / "docs/zero3/transformers.md"
OUTSIDE_PAGE = ROOT / "docs/zero3/outside-forward.md"

READER_INDEX_ERROR = "Dimension out of range (expected to be in range of [-1, 0], but got 1)"
CONSTRUCTOR_ERROR = (
    "Model is designed to be instantiated using the `Model.from_pretrained(pretrained_model_name_or_path)` "
    "or `Model.from_config(config)` methods."
)
MM_LINE = "sampled_input_embed = sampled_input.view(b * l, c).mm(model.module.shared.weight)"
TRANSPOSE_LINE = 'sampled_input_embed = F.linear(inputs["sampled_input"], model.module.shared.weight.transpose(0, 1))'
# Importing Transformers and starting Trainer take long on a loaded 2-core machine.
TIMEOUT = 600
SHARED_NAMES = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]


def load(snippet):
    """The snippet's namespace, loaded in this process the way torchrun finds its siblings."""
    folder = str((ROOT / snippet).parent)
    sys.path.insert(0, folder)
    try:
        return runpy.run_path(str(ROOT / snippet), run_name="reference")
    finally:
        sys.path.remove(folder)
        sys.modules.pop("tiny_t5", None)


@pytest.fixture(scope="module")
def reference():
    """The wrapper fix trained in this one process without DeepSpeed: same checkpoint, data,
    optimizer (SGD, lr 0.1), one batch of every example per step."""
    from transformers import T5ForConditionalGeneration

    tiny, fixes = load(TINY), load(FIXES)
    directory = tiny["save_tiny_t5"]()
    try:
        model = fixes["SoftInputs"](T5ForConditionalGeneration.from_pretrained(directory))
    finally:
        shutil.rmtree(directory)
    assert not hasattr(model.model.shared.weight, "ds_shape")  # plain PyTorch: not partitioned
    examples = tiny["soft_inputs_dataset"]()
    batch = {key: torch.stack([example[key] for example in examples]) for key in examples[0]}
    optimizer = torch.optim.SGD(model.parameters(), lr=tiny["LR"])
    losses, grads, weights = [], [], []
    for _ in range(tiny["STEPS"]):
        weights.append({name: t.clone() for name, t in model.model.state_dict().items()})
        loss = model(**batch).loss
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    trained = {name: t.clone() for name, t in model.model.state_dict().items()}
    return (losses, grads), trained, Inputs(copy.deepcopy(model), weights)


class Inputs:
    """The gradient plain PyTorch gives soft inputs: the wrapper's product and T5's loss on a
    rank's share of the batch, with the weights the one-process run had at that step."""

    def __init__(self, model, weights):
        self.model, self.weights = model, weights

    def gradient(self, step, sampled_input, labels):
        self.model.model.load_state_dict(self.weights[step])
        sampled_input = sampled_input.clone().requires_grad_()
        self.model(sampled_input=sampled_input, labels=labels).loss.backward()
        self.model.zero_grad()
        return sampled_input.grad


def test_from_pretrained_under_zero3_partitions_the_tied_shared_weight(expect_output):
    result = run_snippet(TINY, 2, call="main", timeout=TIMEOUT).check()
    for rank in range(2):
        facts = result.returned(rank)
        assert facts["zero3"] is True
        assert facts["shape"] == (0,) and facts["ds_shape"] == (32, 16)
        # T5 ties its embeddings and head: one Parameter under four names.
        assert facts["tied"] == SHARED_NAMES
    expect_output(result, output_file(TINY))


def test_the_readers_attempts_fail(expect_output):
    result = run_snippet(READER, 2, call="main", timeout=TIMEOUT).check()
    for rank in range(2):
        got = result.returned(rank)
        # AutoModelForSeq2SeqLM subclass: from_pretrained and from_config build the concrete
        # class, so the subclass __init__ never runs; the constructor runs it and raises.
        assert got["auto"] == ["T5ForConditionalGeneration", "T5ForConditionalGeneration"]
        assert got["constructor"] == ("OSError", CONSTRUCTOR_ERROR, "super().__init__(self, *args)")
        # The reader's compute_loss: outside every forward the weight is empty.
        assert got["mm registered"] == [] and got["transpose registered"] == []
        assert got["mm"] == ("RuntimeError", "mat2 must be a matrix", MM_LINE)
        assert got["transpose"] == ("IndexError", READER_INDEX_ERROR, TRANSPOSE_LINE)
        # The concrete subclass's __init__ runs and registers the weight; the loss fails the same way.
        assert got["registered registered"] == [True]
        assert got["registered"] == ("RuntimeError", "mat2 must be a matrix", MM_LINE)
    expect_output(result, output_file(READER))


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_fixes_train_like_plain_pytorch(world_size, reference, expect_output):
    (losses, grads), trained, inputs = reference
    result = run_snippet(FIXES, world_size, call="main", timeout=TIMEOUT).check()
    try:
        for rank in range(world_size):
            got = result.returned(rank)
            assert_same_training(got["wrapper"], (losses, grads), f"wrapper, rank {rank}")
            # GatheredParameters in compute_loss trains the T5 itself: its parameter names have
            # no "model." prefix. Nothing is registered: the tied head needs no registration.
            unprefixed = [{name.removeprefix("model."): g for name, g in step.items()} for step in grads]
            assert_same_training(got["gathered"], (losses, unprefixed), f"gathered, rank {rank}")
            # Differentiable inputs break the rule of GatheredParameters (autograd needs the
            # weight after the block). In this T5 under Trainer it raised nothing, and trained
            # as plain PyTorch: when backward reached the product the weight was gathered again
            # (AVAILABLE, full shape), so even the inputs' gradients are plain PyTorch's.
            assert got["invalid"] is None, got["invalid"]
            assert_same_training(got["differentiable"], (losses, unprefixed), f"differentiable, rank {rank}")
            assert got["weight_in_backward"] == [("AVAILABLE", (32, 16))] * len(losses)
            assert len(got["input_grads"]) == len(losses)
            for step, (sampled_input, labels, gradient) in enumerate(got["input_grads"]):
                assert sampled_input.shape[0] == 8 // world_size  # this rank's share of the batch
                torch.testing.assert_close(gradient, inputs.gradient(step, sampled_input, labels),
                                           rtol=1e-5, atol=1e-6, msg=f"input gradient, rank {rank}, step {step}")
            if rank == 0:  # the rank that writes files: the wrapper's tied weights stop safetensors
                kind, message, line = got["save_model"]
                assert kind == "RuntimeError" and message.startswith("Some tensors share memory"), message
                assert all(f"'model.{name}'" in message for name in SHARED_NAMES), message
            else:
                assert got["save_model"] is None
        # The inner model, saved from the gathered state dict, reloads as the trained model.
        from transformers import T5ForConditionalGeneration

        reloaded = T5ForConditionalGeneration.from_pretrained(result.returned(0)["saved"]).state_dict()
        assert reloaded.keys() == trained.keys()
        for name, tensor in trained.items():
            torch.testing.assert_close(reloaded[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        shutil.rmtree(result.returned(0)["saved"], ignore_errors=True)
    if world_size == 2:
        expect_output(result, output_file(FIXES))


def test_the_pages_show_these_runs():
    page = PAGE.read_text()
    for snippet in (TINY, READER, FIXES):
        assert f'--8<-- "{output_file(snippet).relative_to(ROOT)}"' in page, snippet
    # The reader's exact message is in an output file the page includes.
    assert f"IndexError: {READER_INDEX_ERROR}" in output_file(READER).read_text()
    outside = OUTSIDE_PAGE.read_text()
    assert "Not tested here" not in outside
    assert f'--8<-- "{output_file(READER).relative_to(ROOT)}"' in outside
    for linking in (outside, (ROOT / "docs/zero3/troubleshooting.md").read_text()):
        assert "(transformers.md)" in linking
