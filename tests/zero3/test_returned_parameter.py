"""snippets/zero3/returned_parameter.py: a submodule's weight returned as a top-level entry of
its output (a tuple's item, a dict's value) is detected and trains as in one process for three
steps; nested one level deeper (a dict inside a tuple) it is not, and the first forward fails
with the exact message; registering it fixes that. On 2 and 4 ranks."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace, train_in_one_process
from rankrun.runner import run_snippet

SNIPPET = "snippets/zero3/returned_parameter.py"
NESTED_ERROR = "RuntimeError: size mismatch, got input (10), mat (10x8), vec (0)"


@pytest.fixture(scope="module")
def example():
    return example_namespace(SNIPPET)


def one_process(example, form):
    torch.manual_seed(example["SEED"])
    model = example["LanguageModel"](form)
    batches = [example["make_batch"](step) for step in range(example["STEPS"])]
    vocab = example["VOCAB"]
    return train_in_one_process(
        model, batches, lambda logits, t: F.cross_entropy(logits.reshape(-1, vocab), t.reshape(-1)),
        example["LR"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_only_top_level_entries_are_detected(world_size, example, expect_output):
    assert example["STEPS"] >= 3
    references = {form: one_process(example, form) for form in example["FORMS"]}
    # Every form computes the same model: the references agree with each other.
    for form, reference in references.items():
        assert_same_training({"losses": reference[0], "grads": reference[1]}, references["tuple"], form)
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert list(got) == list(example["CASES"])
        for name, (form, register) in example["CASES"].items():
            label = f"rank {rank} {name}"
            if form == "dict inside a tuple" and not register:
                assert got[name] == {"step": 0, "error": NESTED_ERROR}, label
            else:
                assert_same_training(got[name], references[form], label)
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
