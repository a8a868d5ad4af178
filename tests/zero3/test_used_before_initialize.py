"""snippets/zero3/used_before_initialize.py on 2 and 4 ranks. A model built in zero.Init and
run before deepspeed.initialize fails on every rank with the exact message; inside
GatheredParameters, and through the engine after deepspeed.initialize, its outputs equal the same
model's in one process. A head added after zero.Init is a full plain parameter until
deepspeed.initialize partitions it, and three steps of training with it equal plain PyTorch
(losses and every full gradient)."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/zero3/used_before_initialize.py"
EXAMPLE = example_namespace(SNIPPET)
VOCAB, HIDDEN = EXAMPLE["VOCAB"], EXAMPLE["HIDDEN"]


def one_process():
    """The same seeds, model, added head, batches and SGD, in this process without DeepSpeed."""
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["Encoder"]()
    with torch.no_grad():
        outputs = model(EXAMPLE["tokens"]())
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["Encoder"]()
    model.head = torch.nn.Linear(HIDDEN, VOCAB)
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    losses, grads = [], []
    for step in range(EXAMPLE["STEPS"]):
        batch = EXAMPLE["tokens"](step)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return outputs, (losses, grads)


@pytest.mark.parametrize("world_size", [2, 4])
def test_model_used_before_and_layers_added_after(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    outputs, training = one_process()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["early"] == "RuntimeError: 'weight' must be 2-D", (rank, got["early"])
        assert_matches(got["gathered"], outputs, f"rank {rank} inside GatheredParameters")
        assert_matches(got["engine"], outputs, f"rank {rank} through the engine")
        assert got["head"] == {"before": ((VOCAB, HIDDEN), False), "after": ((0,), True),
                               "ds_shape": (VOCAB, HIDDEN)}, got["head"]
        assert_same_training(got["training"], training, f"rank {rank}")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
