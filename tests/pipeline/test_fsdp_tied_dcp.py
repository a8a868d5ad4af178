"""snippets/pipeline/fsdp_tied_dcp.py: dcp.save and dcp.load of a tied model with the
state-dict helpers, under FSDP2 and FSDP1 (and FSDP2 with the flattened optimizer state
dict): both names of the tied weight are written, the optimizer state once; the reloaded
model is tied and resumes exactly as the uninterrupted run, which equals one process. On 2
and 4 ranks."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/pipeline/fsdp_tied_dcp.py"
CASES = ["FSDP2", "FSDP1", "FSDP1, use_orig_params=True",
         "FSDP2, flatten_optimizer_state_dict=True"]
MODEL_KEYS = ["embed.weight", "head.weight", "mixer.bias", "mixer.weight"]


def train_in_one_process():
    """The same model, seed and whole batch, Adam, twice as many steps as before the save."""
    ex = example_namespace(SNIPPET)
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    optimizer = torch.optim.Adam(model.parameters(), lr=ex["LR"])
    tokens, targets = ex["batch"]()
    losses = []
    for _ in range(2 * ex["STEPS"]):
        loss = F.cross_entropy(model(tokens).reshape(-1, ex["VOCAB"]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("world_size", [2, 4])
def test_tied_checkpoint_round_trip(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=300).check()
    ref_losses = train_in_one_process()
    for rank in range(world_size):
        got = result.returned(rank)
        assert list(got["results"]) == CASES
        for name, case in got["results"].items():
            model_keys, adam_keys = case["written"]
            # Both names of the tied weight are written; Adam's state once, under the name
            # the optimizer saw first.
            assert model_keys == MODEL_KEYS, name
            assert adam_keys == ["embed.weight", "mixer.bias", "mixer.weight"], name
            assert case["tied"], name
            # Resuming from the checkpoint is the uninterrupted run, to the bit...
            assert case["resumed"] == case["uninterrupted"], name
            # ...and both are one process's training.
            assert_matches(case["before"] + case["uninterrupted"], ref_losses, name)
        for layout, keys in got["full"].items():
            assert sorted(keys) == MODEL_KEYS, layout
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
