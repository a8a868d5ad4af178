"""snippets/transformers/trl_generation.py: a GRPO-shaped step with TRL's
unwrap_model_for_generation under ZeRO-3, on 2 and 4 ranks whose completions differ in length,
for the plain tied Llama and one whose forward reads the head's weight, the helper given the
engine or the model inside it. On the pinned releases every case trains like one process:
in step 0 every rank samples exactly the completions one process samples with the same weights
and seed, and at each of the three steps the full gradients equal that process's for the
completions the rank sampled (the ranks' losses averaged, as DeepSpeed averages their
gradients). Later steps are compared on the run's own samples: after a step the weights agree
within rounding only, and a sampled token can flip on a rounding difference."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/trl_generation.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
EXAMPLE = example_namespace(SNIPPET)
POLICIES = {"LlamaForCausalLM": EXAMPLE["LlamaForCausalLM"], "HeadReadingLlama": EXAMPLE["HeadReadingLlama"]}
GIVEN = ("engine", "engine.module")


def one_process(policy, world_size, completions):
    """Each step: every rank's prompts with the completions that rank sampled, the mean of
    the ranks' GRPO losses, one SGD step. Also what this process samples in step 0."""
    model = EXAMPLE["tiny_llama"](policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    first_samples = []
    model.eval()
    with torch.no_grad():
        for rank in range(world_size):
            first_samples.append(EXAMPLE["sample"](model, EXAMPLE["prompts"](0, rank), 0, rank))
    model.train()
    grads = []
    for step in range(EXAMPLE["STEPS"]):
        losses = [EXAMPLE["grpo_loss"](model, EXAMPLE["prompts"](step, rank), completions[rank][step])
                  for rank in range(world_size)]
        (sum(losses) / world_size).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return first_samples, grads


@pytest.mark.parametrize("world_size", [2, 4])
def test_generation_in_a_training_step_trains_like_one_process(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    returned = [result.returned(rank) for rank in range(world_size)]
    assert set(returned[0]) == {f"{p}, unwrap_model_for_generation({g}, ...)" for p in POLICIES for g in GIVEN}
    for case in returned[0]:
        records = [got[case] for got in returned]
        for rank, record in enumerate(records):
            assert record["error"] is None, (rank, case, record["error"])
            assert len(record["completions"]) == EXAMPLE["STEPS"]
            for completion in record["completions"]:  # each rank its own length: none waited
                assert completion.shape == (EXAMPLE["PROMPTS"] * EXAMPLE["GROUP"], EXAMPLE["new_tokens"](rank))
        first_samples, grads = one_process(POLICIES[case.split(",")[0]], world_size,
                                           [record["completions"] for record in records])
        for rank, record in enumerate(records):
            label = f"rank {rank}, {case}"
            assert torch.equal(record["completions"][0], first_samples[rank]), label
            for step in range(EXAMPLE["STEPS"]):
                assert_matches(record["grads"][step], grads[step], f"{label} step {step} grads")
        # the steps train: the samples change, the gradients are not zero
        assert not torch.equal(records[0]["completions"][0], records[0]["completions"][1]), case
        assert all(g.abs().sum() > 0 for g in grads[0].values()), case
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
