"""Every cell of the automatic-detection tables, on 2 and 4 ranks: the outcome the page's rule
predicts, each run that works equal to plain PyTorch (loss and every full gradient, both steps),
each failure with its exact message, and the tables on the page are the ones the run printed."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import (INDEX_ERROR, LOOKUP_ERROR, MATMUL_ERROR, OTHERS, OUTSIDE_ERROR, example_namespace,
                               predicted_outcome)
from rankrun.runner import ROOT, run_snippet
from rankrun.tolerance import matches

SNIPPET = "snippets/zero3/automatic_detection.py"
PAGE = ROOT / "docs/zero3/automatic-detection.md"

SILENTLY_WRONG = "changed in a constructor, after `zero.Init` partitioned it"


@pytest.fixture(scope="module")
def example():
    return example_namespace(SNIPPET)


class PlainEngine:
    def __init__(self, module):
        self.module = module

    def __call__(self, tokens):
        return self.module(tokens)


def plain_pytorch(example, model_class, kwargs):
    """The case's model, seed and batches, trained in this process without DeepSpeed (plain SGD)."""
    torch.manual_seed(example["SEED"])
    model = model_class(False, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=example["LR"])
    losses, grads = [], []
    for step in range(example["STEPS"]):
        tokens, targets = example["make_batch"](step)
        logits = model_class.logits(PlainEngine(model), tokens)
        loss = F.cross_entropy(logits.reshape(-1, example["VOCAB"]), targets.reshape(-1))
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def same_run(got, want):
    if "error" in got or not matches(got["losses"], want["losses"]):
        return False
    for got_step, want_step in zip(got["grads"], want["grads"], strict=True):
        if got_step.keys() != want_step.keys():
            return False
        for name, grad in want_step.items():
            if not matches(got_step[name], grad):
                return False
    return True


@marks.files
def test_cases_cover_the_three_tables(example):
    keys = list(example["cases"]())
    assert len([k for k in keys if len(k) == 3]) == len(example["READS"]) * 3 + 2 * 3
    assert [k[0] for k in keys if len(k) == 1] == list(OTHERS)
    assert set(example["WHEN"]) == {"before", "after", "head"}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_cell_on_zero3(world_size, example, expect_output):
    # One launch trains every case (78 ZeRO-3 runs): more than the runner's default timeout
    # on a loaded machine.
    result = run_snippet(SNIPPET, world_size, call="main", timeout=600).check()
    references = {key: plain_pytorch(example, *spec) for key, spec in example["cases"]().items()}
    assert not same_run(references[SILENTLY_WRONG,], references["`engine.module(tokens)` instead of `engine(tokens)`",])
    without_change = references["`self.embeddings.weight`", "after", example["FIRST_USE"]]
    for rank in range(world_size):
        rows = result.returned(rank)
        assert rows.keys() == references.keys()
        for key, want in references.items():
            for register in (False, True):
                got, expected = rows[key][register], predicted_outcome(example, key, register)
                label = f"rank {rank} {key} register={register}: {got.get('error')}"
                if expected is None:
                    assert same_run(got, want), label
                elif expected == "silently wrong":
                    # The constructor's change is lost: the run equals the model *without* the
                    # change, not plain PyTorch with it, and nothing raises.
                    assert same_run(got, without_change) and not same_run(got, want), label
                else:
                    assert (got.get("where"), got.get("error")) == expected, label
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.files
def test_page_renders_the_tables_the_run_printed():
    page = PAGE.read_text()
    assert f'--8<-- "{output_file(SNIPPET).relative_to(ROOT)}"' in page
    printed = output_file(SNIPPET).read_text()
    for message in (MATMUL_ERROR, LOOKUP_ERROR, OUTSIDE_ERROR, INDEX_ERROR):
        assert f"`{message}`" in printed
    # The engine.module row keeps its name: other pages and the release matrix refer to it.
    assert "| `engine.module(tokens)` instead of `engine(tokens)` | works | works |" in printed
    assert "not deprecated" in page
    assert "sharing-cost.md" in page
