"""snippets/pipeline/megatron_four_stages.py: Megatron Core's embedding group on 4 stages (and on
2) is the first and the last stage; the middle stages hold no copy, are in no group, and a
converter's broadcast that asks them for the group raises the reader's AssertionError; guarded,
the broadcast ties the copies, and per-step _allreduce_word_embedding_grads on every stage
trains like one process."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_gpipe_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/pipeline/megatron_four_stages.py"
NO_CUDA = "AssertionError: Torch not compiled with CUDA enabled"
NOT_IN_GROUP = "AssertionError: embedding group is not initialized"


@pytest.fixture(scope="module")
def reference():
    """The snippet's model in one process, one weight for both uses; GPipe micro-batching, SGD."""
    ex = example_namespace(SNIPPET)
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    start = model.embed.weight.detach().clone()
    losses, _ = train_gpipe_in_one_process(ex, model, model.embed.weight)
    return ex, start, losses, model.embed.weight.detach().clone()


@pytest.mark.parametrize("stages", [2, 4])
def test_middle_stages_hold_no_copy_and_the_tie_trains_like_one_process(stages, reference,
                                                                        expect_output):
    result = run_snippet(SNIPPET, stages, call="main", timeout=300).check()
    ex, ref_start, ref_losses, ref_weight = reference
    share = ex["MIXERS"] // stages
    mixers = [f"mixers.{i}.{name}" for i in range(share) for name in ("bias", "weight")]
    for rank in range(stages):
        got = result.returned(rank)
        end = rank in (0, stages - 1)
        if end:
            # The first and the last stage: the embedding group, a copy of the tied weight;
            # GPTModel's start-up tie moves it with .cuda() (no CUDA here).
            assert (got["in_group"], got["group_ranks"]) == (True, [0, stages - 1])
            assert (got["built"], got["holds"]) == (NO_CUDA, None)
            assert got["converted"] == "ok"
            # After the broadcast both copies are the first stage's values, the one-process
            # model's; the last stage had built its own.
            assert torch.equal(got["start"], ref_start)
            own = ["embed.weight"] if rank == 0 else ["head.weight"]
            assert got["parameters"] == sorted(own + mixers)
        else:
            # A middle stage: no group (get_embedding_group(check_initialized=False) is None),
            # no copy; GPTModel builds there and holds neither.
            assert (got["in_group"], got["group_ranks"], got["start"]) == (False, None, None)
            assert got["built"] == "built"
            assert got["holds"] == {"layers": share, "embedding": False,
                                    "output_layer": False, "shared": None}
            assert got["converted"] == NOT_IN_GROUP
            assert got["parameters"] == mixers
        assert_matches(got["losses"], ref_losses, f"rank {rank} losses")
        first, last = got["copies"]
        assert torch.equal(first, last)
        assert_matches(first, ref_weight, f"rank {rank} weight")
    if stages == 4:
        expect_output(result, output_file(SNIPPET))
