"""FSDP2 keeps a tie only inside one FSDP group; separate groups raise at the first forward."""

import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/pipeline/fsdp_tied.py"
MESSAGE = ("Parameter 'head.weight' is shared with a parameter already managed by another FSDP group. "
           "For shared/tied parameters, use fully_shard([module_a, module_b]) to place them in the same FSDP group.")


def train_in_one_process():
    ex = example_namespace(SNIPPET)
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
    return losses, model.embed.weight.detach().clone()


def test_tie_in_one_fsdp_group_matches_one_process():
    result = run_snippet(SNIPPET, 2, call="tie_in_one_group").check()
    ref_losses, ref_weight = train_in_one_process()
    for rank in range(2):
        losses, weight = result.returned(rank)
        assert_matches(losses, ref_losses, "losses")
        assert_matches(weight, ref_weight)


def test_tie_split_over_two_fsdp_groups_raises(expect_output):
    result = run_snippet(SNIPPET, 2)
    assert not result.ok
    raised = [rank.exception for rank in result.ranks if rank.exception]
    assert raised
    for exception in raised:
        assert (exception["name"], exception["message"]) == ("ValueError", MESSAGE)
        # Raised by the first forward of the second model, not by fully_shard().
        assert "logits = model(tokens[mine])" in exception["traceback"]
        assert "_validate_no_duplicate_params" in exception["traceback"]
    # The first model (tie in one group) trained before that.
    assert result.output.count("step ") == 3
    expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 ranks (the printed losses were checked there)"))
