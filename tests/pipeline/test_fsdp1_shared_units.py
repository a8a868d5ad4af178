"""snippets/pipeline/fsdp1_shared_units.py: FSDP1 wraps every layout that splits the tied
weight's owners over units without an error; with use_orig_params=True the first forward
raises (the reading module gets the other unit's flat 1-D shard); with the default
use_orig_params=False an auto-wrap policy that gives the embedding a unit of its own trains
two weights silently. On 2 and 4 ranks."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/fsdp1_shared_units.py"
EMBED_APART, HEAD_APART, AUTO = ("embed in a unit of its own, use_orig_params=True",
                                 "head in a unit of its own, use_orig_params=True",
                                 "auto_wrap_policy=ModuleWrapPolicy({nn.Embedding})")


def train_in_one_process(ex):
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    tokens, targets = ex["batch"]()
    losses = []
    for _ in range(ex["STEPS"]):
        loss = F.cross_entropy(model(tokens).reshape(-1, ex["VOCAB"]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp1_tie_split_over_units(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    ex = example_namespace(SNIPPET)
    ref_losses = train_in_one_process(ex)
    # The head's F.linear gets the rank's share of the token batch and, for its weight,
    # the embedding unit's flat shard: VOCAB * DIM / world elements, one dimension.
    rows = ex["BATCH"] // world_size * ex["SEQ"]
    mismatch = (f"RuntimeError: size mismatch, got input ({rows}), mat ({rows}x{ex['DIM']}), "
                f"vec ({ex['VOCAB'] * ex['DIM'] // world_size})")
    for rank in range(world_size):
        got = result.returned(rank)
        assert list(got) == [EMBED_APART, HEAD_APART, AUTO]
        assert got[EMBED_APART] == {"raised": mismatch}
        assert got[HEAD_APART] == {"raised": "RuntimeError: 'weight' must be 2-D"}
        auto = got[AUTO]
        assert_matches(auto["losses"][0], ref_losses[0], "first loss")
        assert all(gap > 1e-2 for gap in auto["gaps"]), auto["gaps"]
        assert not matches(auto["losses"], ref_losses)
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
