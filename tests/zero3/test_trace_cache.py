"""snippets/zero3/trace_cache.py on 2 and 4 ranks: an auxiliary head used on odd steps only
makes DeepSpeed print "Invalidate trace cache" (with log_trace_cache_warnings on). The head
used on every step, or called on every step with a zero contribution, trains like plain
PyTorch. Skipped on even steps, it does not: ZeRO-3 hands the step-1 gradient of the skipped
head to the step-2 update again, and step 3 differs from plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/zero3/trace_cache.py"
EXAMPLE = example_namespace(SNIPPET)
INVALIDATE = "Invalidate trace cache @ step 3: expected module 3, but got module 6"
AUX = ("aux.weight", "aux.bias")


def train_in_one_process(schedule):
    """Plain PyTorch: a head a step does not call has no gradient, and SGD leaves it alone."""
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["WithAuxiliaryHead"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    aux_in, _ = EXAMPLE["SCHEDULES"][schedule]
    losses, grads = [], []
    for step in range(EXAMPLE["STEPS"]):
        tokens = EXAMPLE["batch"](step)
        aux = "skipped" if aux_in(step) == "zero" else aux_in(step)  # skipped: no call at all
        logits = model(tokens[:, :-1], aux=aux)
        loss = F.cross_entropy(logits.reshape(-1, EXAMPLE["VOCAB"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        grads.append({name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_module_skipped_on_some_steps(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    every = train_in_one_process("every step")
    odd = train_in_one_process("odd steps")
    for rank in range(world_size):
        got = result.returned(rank)
        assert_same_training(got["every step"], every, f"every step, rank {rank}")
        assert_same_training(got["odd steps, always called"], odd, f"always called, rank {rank}")
        skipped = got["odd steps"]
        # Steps 0 to 2 have plain PyTorch's losses, and steps 0 and 1 its gradients.
        assert_matches(skipped["losses"][:3], odd[0][:3], f"odd steps, rank {rank}, losses")
        for step in (0, 1):
            assert_matches(skipped["grads"][step], odd[1][step], f"odd steps, rank {rank}, step {step}")
        # Step 2 skips the head: plain PyTorch gives it no gradient; ZeRO-3 reports (and
        # applies) the step-1 gradient again.
        for name in AUX:
            assert not odd[1][2][name].any()
            assert torch.equal(skipped["grads"][2][name], skipped["grads"][1][name]), name
        assert not matches(skipped["losses"][3:], odd[0][3:])
    stdout = result.ranks[0].stdout
    parts = stdout.split("auxiliary head on ")
    assert [part.split(":")[0] for part in parts[1:]] == list(EXAMPLE["SCHEDULES"])
    counts = [part.count("Invalidate trace cache") for part in parts[1:]]
    # Printed on rank 0 only, at each step whose module order differs from the recorded one.
    assert counts == [0, 2, 0] and parts[2].count(INVALIDATE) == 2, stdout
    assert all("Invalidate" not in rank.stdout for rank in result.ranks[1:])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 4 samples split 2/1/1 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 4 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
