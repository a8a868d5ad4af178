"""snippets/pipeline/fsdp_weight_in_loss.py: after the forward, a loss that reads a sharded
weight gets the full weight (FSDP1's and FSDP2's root unit), a view into freed memory (FSDP1, a
child unit), this rank's flat shard (FSDP1 with use_orig_params=True: the reported loss holds
the penalty divided by the rank count, the weights still train as one process), or a DTensor
(FSDP2, a child group: backward raises). The penalty computed in the owner's forward, and
FSDP2's full_tensor(), train as one process. On 2 and 4 ranks, 3 steps, every weight."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/fsdp_weight_in_loss.py"
MIXED = ("RuntimeError: aten.nll_loss_backward.default got mixed torch.Tensor and DTensor, need "
         "to convert all torch.Tensor to DTensor before calling distributed operators!")


def train_in_one_process(ex, name):
    """The same model, seed and SGD on the whole batch, without FSDP: per step the
    cross-entropy and the penalty, and the final weights."""
    torch.manual_seed(ex["SEED"])
    model = ex["LanguageModel"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    tokens, targets = ex["batch"]()
    cross_entropies, penalties = [], []
    for _ in range(ex["STEPS"]):
        logits, penalty = model(tokens, penalize=name)
        loss = F.cross_entropy(logits.reshape(-1, ex["VOCAB"]), targets.reshape(-1))
        (loss + penalty).backward()
        optimizer.step()
        optimizer.zero_grad()
        cross_entropies.append(loss.item())
        penalties.append(penalty.item())
    return cross_entropies, penalties, {n: p.detach().clone() for n, p in model.named_parameters()}


def overlap(first, end, rank, share):
    return max(0, min(end, (rank + 1) * share) - max(first, rank * share))


def expected_reads(ex, rank, world):
    """FSDP1 with use_orig_params=True flattens a unit's parameters in registration order and
    gives each rank an equal share: the root's [embed 128 | head 128], block 1's
    [weight 64 | bias 8]; the head's and the weight's elements on this rank are an overlap."""
    root, child = ex["ROOT"], ex["CHILD"]
    embed = head = ex["VOCAB"] * ex["DIM"]
    weight, bias = ex["DIM"] * ex["DIM"], ex["DIM"]
    root_held = overlap(embed, embed + head, rank, (embed + head) // world)
    child_held = overlap(0, weight, rank, -(-(weight + bias) // world))
    return {
        ("FSDP1", root): f"Tensor of shape (16, 8), {head} elements held",
        ("FSDP1", child): "Tensor of shape (8, 8), 0 elements held",
        ("FSDP1, use_orig_params=True", root):
            f"Parameter of shape ({root_held},), {root_held} elements held",
        ("FSDP1, use_orig_params=True", child):
            f"Parameter of shape ({child_held},), {child_held} elements held",
        ("FSDP2", root): f"Parameter of shape (16, 8), {head} elements held",
        ("FSDP2", child): f"DTensor of shape (8, 8), {weight // world} elements held",
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_weight_read_in_the_loss(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    ex = example_namespace(SNIPPET)
    reference = {name: train_in_one_process(ex, name) for name in (ex["ROOT"], ex["CHILD"])}
    fsdp1_shard = "FSDP1, use_orig_params=True"
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["seen"] == expected_reads(ex, rank, world_size), rank
        runs = got["results"]
        assert list(runs) == ex["CASES"]
        for (way, where, name), run in runs.items():
            label = f"rank {rank}: {way}, {where}, {name}"
            cross_entropies, penalties, weights = reference[name]
            if (way, where, name) == ("FSDP2", ex["IN_LOSS"], ex["CHILD"]):
                assert run == {"raised": MIXED}, label
                continue
            for parameter, want in weights.items():  # every case trains as one process
                assert_matches(run["weights"][parameter], want, f"{label} {parameter}")
            whole = [c + p for c, p in zip(cross_entropies, penalties)]
            if way == fsdp1_shard and where == ex["IN_LOSS"]:
                # Each rank's penalty is on its own shard: their mean is the penalty / world.
                reported = [c + p / world_size for c, p in zip(cross_entropies, penalties)]
                assert_matches(run["losses"], reported, f"{label} losses")
                assert not matches(run["losses"], whole), label
            else:
                assert_matches(run["losses"], whole, f"{label} losses")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, ("ValueError: 8 samples do not split evenly over 3 ranks; "
                            "run on 2 or 4 ranks"))
