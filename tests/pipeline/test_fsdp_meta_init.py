"""snippets/pipeline/fsdp_meta_init.py: a tied model built on the meta device and sharded with
FSDP2 keeps its tie through to_empty() when fully_shard comes first, or when it is tied again
after to_empty(); to_empty() before fully_shard trains two weights silently; and a checkpoint
without the head's key is refused by a strict load and, loaded with strict=False into the
untied model, leaves the head at its random initialization. On 2 and 4 ranks."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/fsdp_meta_init.py"
KEEPS_THE_TIE = ["fully_shard, then to_empty", "to_empty, tie again, then fully_shard"]
UNTIES = "to_empty, then fully_shard"
NO_HEAD = "no head.weight, strict=False"
REFUSED = ('Error(s) in loading state_dict for FSDPTiedLanguageModel:\n'
           '\tMissing key(s) in state_dict: "head.weight". ')


def train_in_one_process():
    """The same weights (the example's pretrained()), the whole batch (the ranks' shares are
    equal, so the mean of their losses is the whole batch's), SGD, without FSDP."""
    ex = example_namespace(SNIPPET)
    model = ex["TiedLanguageModel"]()
    model.load_state_dict(ex["pretrained"]())
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    tokens, targets = ex["batch"]()
    losses = []
    for _ in range(ex["STEPS"]):
        loss = F.cross_entropy(model(tokens).reshape(-1, ex["VOCAB"]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.embed.weight.detach().clone()


@pytest.mark.parametrize("world_size", [2, 4])
def test_which_orders_keep_the_tie(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    ref_losses, ref_weight = train_in_one_process()
    for rank in range(world_size):
        got = result.returned(rank)
        results = got["results"]
        assert list(results) == [KEEPS_THE_TIE[0], UNTIES, KEEPS_THE_TIE[1], NO_HEAD]
        for order in KEEPS_THE_TIE:
            steps = results[order]["steps"]
            # One Parameter, one storage, after every step; the one-process training.
            assert [(s["one Parameter"], s["one storage"], s["gap"]) for s in steps] == [
                (True, True, 0.0)] * len(ref_losses), order
            assert_matches([s["loss"] for s in steps], ref_losses, f"{order} losses")
            assert_matches(results[order]["embed"], ref_weight, f"{order} weight")
            assert torch.equal(results[order]["head"], results[order]["embed"])
        # to_empty() before fully_shard: two Parameters from then on, no error or warning.
        # The first loss is right (both start from the file), then each weight gets only
        # its own module's gradient.
        steps = results[UNTIES]["steps"]
        assert [(s["one Parameter"], s["one storage"]) for s in steps] == [
            (False, False)] * len(ref_losses)
        assert all(s["gap"] > 1e-2 for s in steps), steps
        assert_matches(steps[0]["loss"], ref_losses[0], "first loss")
        assert not matches([s["loss"] for s in steps], ref_losses)
        assert not matches(results[UNTIES]["embed"], ref_weight)
        # A checkpoint without head.weight: the strict load refuses the tied model...
        assert got["refused"] == REFUSED
        # ...and strict=False reports success while the untied head keeps its random
        # initialization: the first loss is already another, the weights far apart.
        assert got["loaded"] == "<All keys matched successfully>"
        steps = results[NO_HEAD]["steps"]
        assert all(not s["one Parameter"] and s["gap"] > 1.0 for s in steps), steps
        assert abs(steps[0]["loss"] - ref_losses[0]) > 0.5
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked there)"))


def test_the_order_decides_in_every_group_layout():
    """Beyond the page's layout (the root group only), on 4 ranks: with the mixer in a group of
    its own, and with the embedding and the head in one group of their own, fully_shard before
    to_empty() keeps the tie and trains as one process; to_empty() first trains two weights."""
    result = run_snippet(SNIPPET, 4, call="every_group_layout").check()
    ref_losses, ref_weight = train_in_one_process()
    layouts = example_namespace(SNIPPET)["GROUPS"]
    for rank in range(4):
        got = result.returned(rank)
        assert sorted(got) == sorted((layout, first) for layout in layouts
                                     for first in (True, False))
        for (layout, shard_first), run in got.items():
            steps = run["steps"]
            losses = [s["loss"] for s in steps]
            assert [s["one Parameter"] for s in steps] == [shard_first] * len(steps), layout
            if shard_first:
                assert all(s["gap"] == 0.0 for s in steps), layout
                assert_matches(losses, ref_losses, f"{layout} losses")
                assert_matches(run["embed"], ref_weight, f"{layout} weight")
            else:
                assert all(s["gap"] > 1e-2 for s in steps), (layout, steps)
                assert not matches(losses, ref_losses), layout
