"""snippets/zero3/soft_inputs_wrapper.py: the soft-input product in a wrapper's forward trains like plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace, train_in_one_process
from rankrun.results import assert_refused
from rankrun.runner import run_snippet


WRAPPER = "snippets/zero3/soft_inputs_wrapper.py"


def train_wrapper_without_deepspeed():
    example = example_namespace(WRAPPER)
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


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks each rank would take 2 of the 8 samples, 6 in all, and the losses would not be
    the page's: the example says so instead of printing other numbers."""
    result = run_snippet(WRAPPER, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
