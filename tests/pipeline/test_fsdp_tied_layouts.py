"""snippets/pipeline/fsdp_tied_layouts.py: FSDP1 and FSDP2 layouts that keep a tied weight in one
unit train like one process; FSDP1 with the two owners in separate units silently trains two
weights."""

import torch

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/fsdp_tied_layouts.py"
SEPARATE = "FSDP1, embed and head in separate units"


def train_in_one_process():
    """The same model, seed, whole batch (the ranks' shares are equal, so their mean loss is
    the whole batch's) and SGD, without FSDP."""
    ex = example_namespace(SNIPPET)
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    tokens, targets = ex["batch"]()
    losses = []
    for _ in range(ex["STEPS"]):
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, ex["VOCAB"]),
                                                 targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.embed.weight.detach().clone(), ex["LAYOUTS"]


def test_layouts(expect_output):
    result = run_snippet(SNIPPET, 2, call="main").check()
    ref_losses, ref_weight, layouts = train_in_one_process()
    for rank in range(2):
        got = result.returned(rank)
        assert list(got) == layouts
        for layout in layouts:
            if layout == SEPARATE:
                continue
            # Both owners in one unit or group: one weight, the one-process training.
            assert got[layout]["gaps"] == [0.0] * len(ref_losses), layout
            assert_matches(got[layout]["losses"], ref_losses, f"rank {rank} {layout} losses")
            assert_matches(got[layout]["embed"], ref_weight, f"rank {rank} {layout} weight")
        separate = got[SEPARATE]
        # No error and no warning: the first loss is right, then embed.weight and head.weight
        # are two weights, each trained with its own module's gradient only.
        assert separate["warnings"] == []
        assert_matches(separate["losses"][0], ref_losses[0], "first loss")
        assert all(gap > 1e-2 for gap in separate["gaps"]), separate["gaps"]
        assert not matches(separate["losses"], ref_losses)
        assert not matches(separate["embed"], ref_weight)
    expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 ranks (the printed losses were checked there)"))
