"""snippets/pipeline/deepspeed_tied_norm.py: TiedLayerSpec keeps equal only the parameters its
tied_weight_attr names; naming every parameter of both tied modules (two tie keys) trains like
one process."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import backward_over_micro_batches, example_namespace, layers_seeded_like_deepspeed
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/deepspeed_tied_norm.py"
UNLISTED = ["embed.norm.weight", "embed.norm.bias", "mixer.bias"]
LISTED = ["embed.embed.weight", "mixer.weight"]


def train_in_one_process():
    """One EmbeddingWithNorm as input layer and head, one Linear as both mixers, seeded where
    PipelineModule(seed_layers=True) builds each tied module first (layers 0 and 1)."""
    ex = example_namespace(SNIPPET)
    embed, mixer = layers_seeded_like_deepspeed(ex["SEED"], {
        0: ex["EmbeddingWithNorm"], 1: lambda: torch.nn.Linear(ex["DIM"], ex["DIM"])})
    optimizer = torch.optim.SGD([*embed.parameters(), *mixer.parameters()], lr=ex["LR"])

    def loss_of(tokens, targets):
        hidden = ex["mix"](mixer, ex["mix"](mixer, embed(tokens)))
        return ex["cross_entropy"](ex["head"](embed, hidden), targets)

    losses = []
    for _ in range(ex["STEPS"]):
        losses.append(backward_over_micro_batches(ex["micro_batches"](), loss_of))
        optimizer.step()
        optimizer.zero_grad()
    parameters = {**{f"embed.{n}": p.detach().clone() for n, p in embed.named_parameters()},
                  **{f"mixer.{n}": p.detach().clone() for n, p in mixer.named_parameters()}}
    return losses, parameters


@pytest.fixture(scope="module")
def run():
    return run_snippet(SNIPPET, 2, call="main").check()


def test_every_parameter_listed_trains_like_one_process(run, expect_output):
    ref_losses, ref_parameters = train_in_one_process()
    for rank in range(2):
        got = run.returned(rank)["every parameter"]
        assert got["synced"] == {"embed": ["embed.weight", "norm.weight", "norm.bias"],
                                 "mixer": ["weight", "bias"]}
        assert got["tie_ranks"] == {"embed": [0, 1], "mixer": [0, 1]}  # two keys, two groups
        # Every copy equal when built and after every step, every one the one-process value.
        assert all(diff == 0.0 for step in got["differences"] for diff in step.values())
        assert_matches(got["losses"], ref_losses, f"rank {rank} losses")
        assert_matches(got["parameters"], ref_parameters, f"rank {rank} tied parameters")
    expect_output(run, output_file(SNIPPET))


def test_only_the_listed_attributes_are_synced(run):
    ref_losses, ref_parameters = train_in_one_process()
    for rank in range(2):
        got = run.returned(rank)["weights only"]
        assert got["synced"] == {"embed": ["embed.weight"], "mixer": ["weight"]}
        built, *steps = got["differences"]
        # The listed weights: broadcast when built, all-reduced every step.
        assert all(step[name] == 0.0 for step in got["differences"] for name in LISTED)
        # Not listed: not broadcast (stage 1 built its Linear's bias from another seed; the
        # LayerNorm starts at ones and zeros on both stages) ...
        assert built["mixer.bias"] > 0.1
        assert built["embed.norm.weight"] == built["embed.norm.bias"] == 0.0
        # ... and not all-reduced: each stage updates them with its own share of the gradient.
        assert all(step[name] > 1e-2 for step in steps for name in UNLISTED), steps
        # So the model trained is not the one-process model, from the first loss on.
        assert not matches(got["losses"][0], ref_losses[0])
        assert not matches(got["parameters"]["embed.embed.weight"],
                           ref_parameters["embed.embed.weight"])
    assert run.returned(0)["weights only"]["differences"] == run.returned(1)["weights only"]["differences"]
