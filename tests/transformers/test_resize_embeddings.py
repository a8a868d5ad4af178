"""snippets/transformers/resize_embeddings.py: resize_token_embeddings on a tied Llama under
ZeRO-3 on 2 and 4 ranks. Before deepspeed.initialize (inside or outside zero.Init, with
HfDeepSpeedConfig alive) the head stays tied, the old rows are unchanged, and training equals
the same resize in one process; so do an untied head and pad_to_multiple_of; ranks seeded
differently end with rank 0's added rows; the other orders fail with the exact messages."""

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


def original_embedding(tied=True):
    return EXAMPLE["tiny_llama"](tied).get_input_embeddings().weight.detach().clone()


def original_head():
    return EXAMPLE["tiny_llama"](tied=False).get_output_embeddings().weight.detach().clone()


def train_in_one_process(new_rows, tied=True, pad_to=None, new_head_rows=None):
    """The same resize without DeepSpeed, the added rows set to the run's (they are drawn at
    random), then the snippet's training: full batch, SGD."""
    model = EXAMPLE["tiny_llama"](tied)
    model.resize_token_embeddings(VOCAB + ADDED, pad_to_multiple_of=pad_to)
    assert EXAMPLE["tied"](model) is tied
    with torch.no_grad():
        model.get_input_embeddings().weight[VOCAB:] = new_rows
        if new_head_rows is not None:
            model.get_output_embeddings().weight[VOCAB:] = new_head_rows
    tokens = EXAMPLE["batch"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    losses, grads = [], []
    for _ in range(EXAMPLE["STEPS"]):
        logits = model(tokens).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               tokens[:, 1:].reshape(-1))
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def check_resized(facts, original, label, tied=True, rows=VOCAB + ADDED):
    assert facts["tied"] is tied, label
    assert facts["shape"] == facts["head shape"] == (rows, 16), label
    assert facts["vocab_size"] == rows, label
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
    # An untied head is resized as well: its old rows kept, its new rows drawn like the
    # embedding's; and pad_to_multiple_of rounds the rows up (36 to 40), config included.
    untied_rows = ranks[0]["untied"]["resized"]["embedding"][VOCAB:]
    head_rows = ranks[0]["untied"]["resized"]["head"][VOCAB:]
    padded_rows = ranks[0]["padded"]["resized"]["embedding"][VOCAB:]
    rows = VOCAB + ADDED + (-(VOCAB + ADDED)) % EXAMPLE["PAD_TO"]
    assert rows == 40 and padded_rows.shape[0] == rows - VOCAB
    references = {"untied": train_in_one_process(untied_rows, tied=False, new_head_rows=head_rows),
                  "padded": train_in_one_process(padded_rows, pad_to=EXAMPLE["PAD_TO"])}
    for rank, got in enumerate(ranks):
        label = f"untied, rank {rank}"
        for when in ("resized", "initialized"):
            check_resized(got["untied"][when], original_embedding(tied=False), label, tied=False)
            assert torch.equal(got["untied"][when]["head"][:VOCAB], original_head()), label
            check_resized(got["padded"][when], original, f"padded, rank {rank}", rows=rows)
            assert torch.equal(got["padded"][when]["embedding"][VOCAB:], padded_rows)
        # The untied case runs after the ranks were seeded differently: each rank drew its
        # own rows; deepspeed.initialize leaves every rank with rank 0's.
        assert torch.equal(got["untied"]["initialized"]["head"][VOCAB:], head_rows), label
        assert torch.equal(got["untied"]["initialized"]["embedding"][VOCAB:], untied_rows)
        for case, reference in references.items():
            assert_same_training(got[case], reference, f"{case}, rank {rank}")
    # Ranks seeded differently draw different rows; deepspeed.initialize converts the new
    # embedding with rank 0's values (DeepSpeed broadcasts a parameter it converts), and the
    # training is the one-process training with rank 0's rows.
    drawn = [got["unseeded"]["resized"]["embedding"][VOCAB:] for got in ranks]
    assert not any(torch.equal(drawn[0], other) for other in drawn[1:])
    reference = train_in_one_process(drawn[0])
    for rank, got in enumerate(ranks):
        assert torch.equal(got["unseeded"]["initialized"]["embedding"][VOCAB:], drawn[0])
        assert_same_training(got["unseeded"], reference, f"unseeded, rank {rank}")
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
