"""snippets/zero3/prefetch_trace_fixes.py (prefetch_trace.py's model on more schedules) on 2 and 4
ranks, against plain PyTorch in one process. Read on every step, with 0.0 * where a step does
not want it: plain PyTorch's training with the read skipped. Registered in __init__ and read on
odd steps: no error, but the even steps get the previous step's gradient again (as a skipped
module does: trace-cache.md) and step 3 differs. Generation between the steps: plain PyTorch's
losses, gradients and tokens, whether the generation reads nothing new or reads the weight
that training reads with 0.0 *."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import printed_by_the_example
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/zero3/prefetch_trace_fixes.py"
EXAMPLE = example_namespace(SNIPPET, with_siblings=["prefetch_trace"])
SCHEDULES = EXAMPLE["SCHEDULES"]


def plain(schedule):
    """The schedule in one process without DeepSpeed: the losses, aux.weight's gradient (zeros
    where a step does not read it), the tokens generated after each step. A read with 0.0 * is
    skipped here (plain PyTorch without the read); tests/zero3/test_prefetch_trace.py builds the
    same reference for the failing schedules."""
    train_aux, generate_aux, _ = SCHEDULES[schedule]
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["ReadsHeadWeight"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    losses, grads, generated = [], [], []
    for step in range(EXAMPLE["STEPS"]):
        tokens = EXAMPLE["batch"](step)
        aux = "skipped" if train_aux(step) == "zero" else train_aux(step)
        logits = model(tokens[:, :-1], aux=aux)
        loss = F.cross_entropy(logits.reshape(-1, EXAMPLE["VOCAB"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        grad = model.aux.weight.grad
        grads.append(torch.zeros_like(model.aux.weight) if grad is None else grad.clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if generate_aux is not None:
            model.eval()
            with torch.no_grad():
                sequence = EXAMPLE["batch"](step)[:, :2]
                for _ in range(EXAMPLE["NEW_TOKENS"]):
                    next_token = model(sequence, aux=generate_aux)[:, -1:].argmax(-1)
                    sequence = torch.cat([sequence, next_token], dim=1)
            model.train()
            generated.append(sequence)
    return losses, grads, generated


def assert_plain(got, reference, label):
    losses, grads, generated = reference
    assert_matches(got["losses"], losses, f"{label}, losses")
    assert_matches(got["grads"], grads, f"{label}, aux.weight gradients")
    assert len(got["generated"]) == len(generated), label
    for step, (mine, theirs) in enumerate(zip(got["generated"], generated)):
        assert torch.equal(mine, theirs), f"{label}, tokens generated after step {step}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_reading_the_weight_on_every_step_trains_as_plain_pytorch(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    references = {schedule: plain(schedule) for schedule in SCHEDULES}
    for rank in range(world_size):
        got = result.returned(rank)
        assert list(got) == list(SCHEDULES)
        for schedule in ("odd steps, 0.0 * on the others", "no step, generation between steps",
                         "generation only, 0.0 * in training"):
            assert_plain(got[schedule], references[schedule], f"{schedule}, rank {rank}")
        # Registered: no error; steps 0 to 2 have plain PyTorch's losses and steps 0 and 1 its
        # gradients; step 2 (no read) gets step 1's gradient again, and step 3 differs.
        registered = got["odd steps, registered in __init__"]
        losses, grads, _ = references["odd steps, registered in __init__"]
        assert_matches(registered["losses"][:3], losses[:3], f"registered, rank {rank}, losses")
        assert_matches(registered["grads"][:2], grads[:2], f"registered, rank {rank}, gradients")
        assert not grads[2].any() and registered["grads"][1].any()
        assert torch.equal(registered["grads"][2], registered["grads"][1])
        assert not matches(registered["losses"][3:], losses[3:])
    # The generation that reads aux.weight decodes other tokens than the one that does not:
    # the read reaches the output.
    assert not all(torch.equal(a, b) for a, b in zip(
        references["no step, generation between steps"][2], references["generation only, 0.0 * in training"][2]))
    assert all(printed_by_the_example(rank.stdout) == "" for rank in result.ranks[1:])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
