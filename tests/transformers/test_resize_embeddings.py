"""snippets/transformers/resize_embeddings.py: resize_token_embeddings on a tied Llama under
ZeRO-3 on 2 and 4 ranks. Before deepspeed.initialize (inside or outside zero.Init, with
HfDeepSpeedConfig alive) the head stays tied, the old rows are unchanged, and training equals
the same resize in one process; the other orders fail with the exact messages."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet

SNIPPET = "snippets/transformers/resize_embeddings.py"
TIMEOUT = 600  # Transformers and three engines on a loaded 2-core machine
EXAMPLE = example_namespace(SNIPPET)
VOCAB, ADDED = EXAMPLE["VOCAB"], EXAMPLE["ADDED"]


def original_embedding():
    return EXAMPLE["tiny_llama"]().get_input_embeddings().weight.detach().clone()


def train_in_one_process(new_rows):
    """The same resize without DeepSpeed, the added rows set to the run's (they are drawn at
    random), then the snippet's training: full batch, SGD."""
    model = EXAMPLE["tiny_llama"]()
    model.resize_token_embeddings(VOCAB + ADDED)
    assert EXAMPLE["tied"](model)
    with torch.no_grad():
        model.get_input_embeddings().weight[VOCAB:] = new_rows
    tokens = EXAMPLE["batch"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    losses, grads = [], []
    for _ in range(EXAMPLE["STEPS"]):
        logits = model(tokens).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB + ADDED), tokens[:, 1:].reshape(-1))
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def check_resized(facts, original, label):
    assert facts["tied"], label
    assert facts["shape"] == (VOCAB + ADDED, 16), label
    assert facts["vocab_size"] == VOCAB + ADDED, label
    assert torch.equal(facts["embedding"][:VOCAB], original), f"{label}: old rows changed"


@pytest.mark.parametrize("world_size", [2, 4])
def test_resize_before_initialize_trains_like_one_process(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    original = original_embedding()
    ranks = [result.returned(rank) for rank in range(world_size)]
    for order in ("before", "outside"):
        new_rows = ranks[0][order]["resized"]["embedding"][VOCAB:]
        reference = train_in_one_process(new_rows)
        for rank, got in enumerate(ranks):
            label = f"{order}, rank {rank}"
            check_resized(got[order]["resized"], original, label)
            # The added rows are drawn on every rank from the same seeded generator.
            assert torch.equal(got[order]["resized"]["embedding"][VOCAB:], new_rows), label
            assert_same_training(got[order], reference, label)
        assert not ranks[0][order]["resized"]["partitioned"]  # a new, full Parameter
    for rank, got in enumerate(ranks):
        assert got["before"]["initialized"]["tied"] and got["before"]["initialized"]["partitioned"]
        assert got["after"][0] == AFTER, got["after"]
        assert got["no_config"][0] == NO_CONFIG, got["no_config"]
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


# The engine's hooks meet the new embedding Parameter, which was never converted by ZeRO-3.
AFTER = "AttributeError: 'Parameter' object has no attribute 'ds_status'"
# Without HfDeepSpeedConfig resize reads the partitioned weight's size: (0,).
NO_CONFIG = "ValueError: not enough values to unpack (expected 2, got 1)"


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main", timeout=TIMEOUT)
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
