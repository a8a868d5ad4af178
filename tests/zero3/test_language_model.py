"""LanguageModel under ZeRO-3 equals the same model trained without DeepSpeed."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace, train_in_one_process
from rankrun.results import assert_refused
from rankrun.runner import ROOT, check_torchrun, printed_by_the_example, run_snippet, run_torchrun

SNIPPET = "snippets/zero3/language_model.py"


def train_without_deepspeed():
    """The snippet's model, data and optimizer in one plain-PyTorch process."""
    example = example_namespace(SNIPPET)
    torch.manual_seed(example["SEED"])
    vocab = example["VOCAB"]
    return train_in_one_process(
        example["LanguageModel"](),
        (example["make_batch"](step) for step in range(example["STEPS"])),
        lambda logits, targets: F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)),
        example["LR"],
    )


@pytest.fixture(scope="module")
def reference():
    return train_without_deepspeed()


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_matches_plain_pytorch(world_size, reference, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for rank in range(world_size):
        assert_same_training(result.returned(rank), reference, f"rank {rank}")
    expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))


@pytest.mark.slow  # torchrun and two new interpreters: what the pool saves everywhere else
def test_documented_torchrun_command_prints_the_output_file():
    """The command on the page, run for real: torchrun, 2 CPU processes."""
    command = ["torchrun", "--nproc_per_node", "2", SNIPPET]
    assert " ".join(command) in (ROOT / "docs/zero3/external-parameters.md").read_text()
    done = check_torchrun(run_torchrun(SNIPPET))
    assert printed_by_the_example(done.stdout) == output_file(SNIPPET).read_text()
