"""snippets/zero3/full_weights_in_training.py: logging, EMA, surgery and full gradients during training
equal plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches


JOBS = "snippets/zero3/full_weights_in_training.py"


def train_jobs_without_deepspeed():
    example = example_namespace(JOBS)
    torch.manual_seed(example["SEED"])
    model = example["build_model"]()
    optimizer = torch.optim.Adam(model.parameters(), lr=example["LR"])
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses, grads, norms = [], [], []
    for step in range(example["STEPS"]):
        if step == example["SURGERY_STEP"]:
            with torch.no_grad():
                model[0].weight[0] = 0.0
        inputs, targets = example["make_batch"](step)
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        grads.append(model[0].weight.grad.clone())
        optimizer.step()
        optimizer.zero_grad()
        norms.append(model[0].weight.norm().item())
        for name, param in model.named_parameters():
            ema[name].mul_(example["DECAY"]).add_(param.detach(), alpha=1 - example["DECAY"])
        losses.append(loss.item())
    return losses, grads, norms, ema


@pytest.mark.parametrize("world_size", [2, 4])
def test_jobs_on_full_weights_match_plain_pytorch(world_size, expect_output):
    losses, grads, norms, ema = train_jobs_without_deepspeed()
    result = run_snippet(JOBS, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert_matches(got["losses"], losses, str(rank))
        assert_matches(got["norms"], norms, str(rank))
        for step, (g, want) in enumerate(zip(got["grads"], grads)):
            assert_matches(g, want, f"rank {rank} step {step}")
        assert got["ema"].keys() == ema.keys()
        for name in ema:
            assert_matches(got["ema"][name], ema[name], f"rank {rank} {name}")
    if world_size == 2:
        expect_output(result, output_file(JOBS))
