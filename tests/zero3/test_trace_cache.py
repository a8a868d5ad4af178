"""snippets/zero3/trace_cache.py on 2 and 4 ranks: an auxiliary head used on odd steps only
makes DeepSpeed print "Invalidate trace cache" (with log_trace_cache_warnings on), and the
training still equals plain PyTorch, like the head used on every step."""

import runpy

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import assert_same_training
from rankrun.runner import ROOT, run_snippet

SNIPPET = "snippets/zero3/trace_cache.py"
EXAMPLE = runpy.run_path(str(ROOT / SNIPPET), run_name="reference")
INVALIDATE = "Invalidate trace cache @ step 3: expected module 3, but got module 6"


def train_in_one_process(schedule):
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["WithAuxiliaryHead"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    losses, grads = [], []
    for step in range(EXAMPLE["STEPS"]):
        tokens = EXAMPLE["batch"](step)
        logits = model(tokens[:, :-1], use_aux=EXAMPLE["uses_aux"](schedule, step))
        loss = F.cross_entropy(logits.reshape(-1, EXAMPLE["VOCAB"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        grads.append({name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("world_size", [2, 4])
def test_invalidated_trace_trains_like_plain_pytorch(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for schedule in ("every step", "odd steps"):
        reference = train_in_one_process(schedule)
        for rank in range(world_size):
            assert_same_training(result.returned(rank)[schedule], reference, f"{schedule}, rank {rank}")
    every, odd = result.ranks[0].stdout.split("auxiliary head on odd steps:")
    assert "Invalidate trace cache" not in every
    # Printed on rank 0 only, at each step whose module order differs from the recorded one.
    assert odd.count("Invalidate trace cache") == odd.count(INVALIDATE) == 2, odd
    assert all("Invalidate" not in rank.stdout for rank in result.ranks[1:])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
