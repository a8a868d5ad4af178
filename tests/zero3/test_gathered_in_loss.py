"""snippets/zero3/gathered_in_loss.py: GatheredParameters in a loss works when backward does not need the
weight's values after the block, and fails in backward when it does."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet


IN_LOSS = "snippets/zero3/gathered_in_loss.py"


def train_in_loss_without_deepspeed(trainable):
    example = example_namespace(IN_LOSS)
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


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks each rank would take 2 of the 8 samples, 6 in all, and the losses would not be
    the page's: the example says so instead of printing other numbers."""
    result = run_snippet(IN_LOSS, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
