"""snippets/transformers/trl_generation.py: a GRPO-shaped step with TRL's
unwrap_model_for_generation under ZeRO-3, on 2 and 4 ranks whose completions differ in length.
Given the engine or the model inside it, on the pinned releases, every rank samples exactly the
completions one process samples with the same weights and seeds, and the three steps' full
gradients and rewards equal that process's (the ranks' losses averaged, as DeepSpeed averages
their gradients)."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/trl_generation.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
EXAMPLE = example_namespace(SNIPPET)
CASES = ("unwrap_model_for_generation(engine, ...)", "unwrap_model_for_generation(engine.module, ...)")


def one_process(world_size):
    """Each step: every rank's prompts sampled with that rank's seed by the one model, the
    mean of the ranks' GRPO losses, one SGD step."""
    model = EXAMPLE["tiny_llama"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    record = {"rewards": [], "grads": [], "completions": []}
    for step in range(EXAMPLE["STEPS"]):
        losses, rewards, completions = [], [], []
        for rank in range(world_size):
            prompt_ids = EXAMPLE["prompts"](step, rank)
            model.eval()
            with torch.no_grad():
                completion_ids = EXAMPLE["sample"](model, prompt_ids, step, rank)
            model.train()
            losses.append(EXAMPLE["grpo_loss"](model, prompt_ids, completion_ids))
            rewards.append(EXAMPLE["reward"](completion_ids).mean().item())
            completions.append(completion_ids)
        (sum(losses) / world_size).backward()
        record["grads"].append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        record["rewards"].append(sum(rewards) / world_size)
        record["completions"].append(completions)
    return record


@pytest.mark.parametrize("world_size", [2, 4])
def test_generation_in_a_training_step_equals_one_process(world_size, expect_output):
    want = one_process(world_size)
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert set(got) == set(CASES)
        for case in CASES:
            record, label = got[case], f"rank {rank}, {case}"
            assert record["error"] is None, (label, record["error"])
            for step in range(EXAMPLE["STEPS"]):
                completion = record["completions"][step]
                assert completion.shape[1] == EXAMPLE["new_tokens"](rank), label
                assert torch.equal(completion, want["completions"][step][rank]), (label, step)
                assert_matches(record["grads"][step], want["grads"][step], f"{label} step {step} grads")
            assert_matches(record["rewards"], want["rewards"], f"{label} rewards")
    # the steps trained: the rewards differ from step to step, the gradients are not zero
    assert len(set(want["rewards"])) > 1
    assert all(g.abs().sum() > 0 for g in want["grads"][0].values())
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
