"""snippets/pipeline/fsdp_tied_uneven.py: a tied weight of 15 rows, which neither 2 nor 4 ranks
divide, in one FSDP2 group trains like one process: the losses and the final weight equal the
one-process run's, and every row of every rank's shard (the last, shorter one too) changed,
as every row does in one process."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches
from rankrun import marks

SNIPPET = "snippets/pipeline/fsdp_tied_uneven.py"
EX = example_namespace(SNIPPET)


def train_in_one_process():
    torch.manual_seed(EX["SEED"])
    model = EX["TiedLanguageModel"]()
    start = model.embed.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=EX["LR"])
    tokens, targets = EX["batch"]()
    losses = []
    for _ in range(EX["STEPS"]):
        loss = F.cross_entropy(model(tokens).reshape(-1, EX["VOCAB"]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.embed.weight.detach().clone(), start


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_shards_of_a_tie_in_one_group_train_like_one_process(world_size, expect_output):
    ref_losses, ref_weight, start = train_in_one_process()
    assert bool((ref_weight != start).any(dim=1).all())  # every row changes in one process
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        rows = [len(r) for r in torch.arange(EX["VOCAB"]).chunk(world_size)]
        assert got["rows"] == rows and len(set(rows)) == 2  # the last shard is shorter
        assert got["every row of the shard changed"] == [True] * world_size
        assert_matches(got["losses"], ref_losses, f"rank {rank} losses")
        assert_matches(got["weight"], ref_weight, f"rank {rank} weight")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
