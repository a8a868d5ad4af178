"""snippets/transformers/trl_generation.py: a GRPO-shaped step with TRL's
unwrap_model_for_generation under ZeRO-3, on 2 and 4 ranks whose completions differ in length,
for the plain tied Llama and one whose forward reads the head's weight, the helper given the
engine or the model inside it, synced_gpus left to generate() or (engine) False.
What keeps the ranks in step: accelerate keeps an HfDeepSpeedConfig alive, so generate()
turns synced_gpus on and every rank runs as many forwards as the longest rank's tokens; with
synced_gpus=False each rank runs its own number. Given the engine, the weights stay whole
through generate(); given the model inside, DeepSpeed's hooks release them after each
forward (every token gathers again), and with synced_gpus=False rank 0 aborts in gloo on
mismatched collectives. On the pinned releases every case trains like one process:
in step 0 every rank samples exactly the completions one process samples with the same weights
and seed, and at each of the three steps the full gradients equal that process's for the
completions the rank sampled (the ranks' losses averaged, as DeepSpeed averages their
gradients). Later steps are compared on the run's own samples: after a step the weights agree
within rounding only, and a sampled token can flip on a rounding difference."""

import signal

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/trl_generation.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
EXAMPLE = example_namespace(SNIPPET)
# What gloo says when two ranks' collectives do not match (rank 0's stderr, before SIGABRT).
MISMATCH = "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?"
POLICIES = {"LlamaForCausalLM": EXAMPLE["LlamaForCausalLM"], "HeadReadingLlama": EXAMPLE["HeadReadingLlama"]}
CASES = {f"{policy}, unwrap_model_for_generation({given}, ...)" + ("" if synced is None else f", synced_gpus={synced}"):
         (given, synced) for policy in POLICIES
         for given, synced in (("engine", None), ("engine.module", None), ("engine", False))}


def one_process(policy, world_size, completions):
    """Each step: every rank's prompts with the completions that rank sampled, the mean of
    the ranks' GRPO losses, one SGD step. Also what this process samples in step 0."""
    model = EXAMPLE["tiny_llama"](policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    first_samples = []
    model.eval()
    with torch.no_grad():
        for rank in range(world_size):
            first_samples.append(EXAMPLE["sample"](model, EXAMPLE["prompts"](0, rank), 0, rank)[0])
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
    assert set(returned[0]) == set(CASES)
    longest = max(EXAMPLE["new_tokens"](rank) for rank in range(world_size))
    for case in returned[0]:
        records = [got[case] for got in returned]
        given, synced = CASES[case]
        for rank, record in enumerate(records):
            # accelerate's DeepSpeedPlugin keeps an HfDeepSpeedConfig alive: generate's default is on
            assert record["synced_gpus_default"] is True, (rank, case)
            for seen in record["generate"]:
                # synced: a finished rank runs forwards until the longest rank is done
                want = longest if synced is None else EXAMPLE["new_tokens"](rank)
                assert seen["forwards"] == want, (rank, case, seen)
                # given the engine the hooks are off and the gathered weights stay whole;
                # given the model inside, the hooks release them after every forward
                assert seen["whole"] == (seen["weights"] if given == "engine" else 0), (rank, case, seen)
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


@pytest.mark.parametrize("world_size", [2, 4])
def test_model_inside_with_synced_gpus_false_aborts_on_mismatched_collectives(world_size):
    """Given the model inside the engine, every token's forward gathers its weights again; a
    rank that finishes first goes on to its training forward, whose collectives meet the other
    ranks' gathers of generate() with other sizes, and gloo aborts the rank (no hang)."""
    result = run_snippet(SNIPPET, world_size, call="model_inside_unsynced", timeout=TIMEOUT)
    assert not result.ok and not result.hung and not result.timed_out, result.failure_report()
    aborted = [rank for rank in result.ranks if rank.exit_code == -signal.SIGABRT]
    assert [rank.rank for rank in aborted] == [0], result.failure_report()
    assert MISMATCH in aborted[0].stderr, aborted[0].stderr[-2000:]
    assert all(rank.exception is None for rank in result.ranks), result.failure_report()
