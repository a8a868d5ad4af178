"""snippets/zero3/gathered_in_loss_tied.py on 2 and 4 ranks: GatheredParameters around a product
in the loss, trainable weight, data inputs. With a decoder embedding fed token ids sharing the
weight (T5's shape) it trains like plain PyTorch, and the weight is whole when backward
reaches the product, with default reuse and prefetch and with both at 0; fed one-hot rows
that require grad, or without that embedding, backward fails with the weight empty there."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun import marks
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/zero3/gathered_in_loss_tied.py"
EXAMPLE = example_namespace(SNIPPET)
EMPTY_IN_BACKWARD = ("step 0: RuntimeError: The size of tensor a (0) must match the size of tensor b (8) "
                     "at non-singleton dimension 1")
TRAINS = ("decoder embedding fed token ids", "decoder embedding fed token ids, reuse 0, prefetch 0")
FAILS = ("decoder embedding fed one-hot rows that require grad", "no decoder embedding")


def plain_pytorch(case):
    """The case's model and loss in one process without DeepSpeed (GatheredParameters does
    nothing there), plain SGD over the whole batch."""
    kind, _ = EXAMPLE["CASES"][case]
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["TiedSeq2Seq"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    vocab, dim = EXAMPLE["VOCAB"], EXAMPLE["DIM"]
    losses, grads = [], []
    for step in range(EXAMPLE["STEPS"]):
        sampled_input, targets, decoder_ids = EXAMPLE["make_batch"](step)
        b, l, c = sampled_input.shape
        embeds = sampled_input.reshape(b * l, c).mm(model.shared.weight).view(b, l, dim)
        logits = model(embeds, EXAMPLE["decoder_input"](kind, decoder_ids))
        loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_module_fed_token_ids_keeps_the_weight_for_the_product(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    references = {case: plain_pytorch(case) for case in TRAINS}
    for rank in range(world_size):
        got = result.returned(rank)
        assert list(got) == list(EXAMPLE["CASES"])
        for case in TRAINS:
            label = f"rank {rank}, {case}"
            assert got[case]["error"] is None, label
            assert got[case]["seen"] == ["AVAILABLE"] * EXAMPLE["STEPS"], label
            losses, grads = references[case]
            assert_matches(got[case]["losses"], losses, f"{label} losses")
            for step, (got_step, want_step) in enumerate(zip(got[case]["grads"], grads, strict=True)):
                assert_matches(got_step, want_step, f"{label} step {step}")
        for case in FAILS:
            label = f"rank {rank}, {case}"
            assert got[case]["error"] == EMPTY_IN_BACKWARD, label
            assert got[case]["seen"] == ["NOT_AVAILABLE"], label
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
