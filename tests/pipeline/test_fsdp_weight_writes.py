"""snippets/pipeline/fsdp_weight_writes.py: a change to a sharded weight between steps is kept
by FSDP1's summon_full_params() (writeback=True, in place) and by an in-place op on FSDP2's
DTensor; it is lost without a word with writeback=False, with `.data` assigned, through
FSDP2's full_tensor() and through unshard()/reshard() (the run then equals one process that
never made the change); rank0_only=True and, on CPU, offload_to_cpu=True raise. 2 and 4 ranks."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/fsdp_weight_writes.py"
KEPT = {("FSDP1", "summon_full_params()"),
        ("FSDP1, use_orig_params=True", "summon_full_params()"),
        ("FSDP2", "masked_fill_ on the DTensor, the mask distributed like it")}
LOST = {("FSDP1", "summon_full_params(writeback=False)"),
        ("FSDP1", "summon_full_params(), .data assigned"),
        ("FSDP2", "full_tensor(), masked_fill_"),
        ("FSDP2", "unshard(), masked_fill_, reshard()")}
RAISED = {("FSDP1", "summon_full_params(rank0_only=True)"):
          "NotImplementedError: writeback=True and rank0_only=True is not supported yet",
          ("FSDP1", "summon_full_params(offload_to_cpu=True)"):
          "RuntimeError: setStorage: sizes [128], strides [1], storage offset 0, and itemsize 4 "
          "requiring a storage size of 512 are out of bounds for storage of size 0"}


def train_in_one_process(ex, change):
    """The same model, seed and SGD on the whole batch, without FSDP; with `change`, the
    head's masked entries set to zero after the first step."""
    torch.manual_seed(ex["SEED"])
    model = ex["LanguageModel"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    tokens, targets = ex["batch"]()
    losses = []
    for step in range(ex["STEPS"]):
        if step == 1 and change:
            with torch.no_grad():
                model.head.weight.masked_fill_(ex["pruned"](), 0.0)
        loss = F.cross_entropy(model(tokens).reshape(-1, ex["VOCAB"]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_which_changes_are_kept(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    ex = example_namespace(SNIPPET)
    assert set(ex["CASES"]) == KEPT | LOST | set(RAISED)
    changed, unchanged = train_in_one_process(ex, True), train_in_one_process(ex, False)
    assert not matches(changed[0], unchanged[0])  # the change shows in the losses
    for rank in range(world_size):
        got = result.returned(rank)
        assert list(got) == ex["CASES"]
        for case, message in RAISED.items():
            assert got[case] == {"raised": message}, (rank, case)
        for case in KEPT | LOST:
            label = f"rank {rank}: {case}"
            losses, weights = changed if case in KEPT else unchanged
            assert got[case]["zeros"] == (0.5 if case in KEPT else 0.0), label
            assert_matches(got[case]["losses"], losses, f"{label} losses")
            for name, want in weights.items():
                assert_matches(got[case]["weights"][name], want, f"{label} {name}")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, ("ValueError: 8 samples do not split evenly over 3 ranks; "
                            "run on 2 or 4 ranks"))
