"""snippets/zero3/free_active_param.py on 2 and 4 ranks: GatheredParameters(fwd_module=self)
inside the module's own forward raises "Cannot free a ZeRO-3 parameter ..." in step 1 (after a
step 0 equal to plain PyTorch). All weights gathered around a forward train like plain
PyTorch, but DeepSpeed's hooks release every weight inside that block (each step, once the
forward returned); no gather at all trains like plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace, train_in_one_process
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/zero3/free_active_param.py"
CANNOT_FREE = ("RuntimeError: Cannot free a ZeRO-3 parameter while it is still active in "
               "submodules. This can happen if: (1) submodules have not released the parameter")
# The top module (ds_id 0) holds the weight: its forward is running when the block ends.
ACTIVE = "'status': 'AVAILABLE'"


@pytest.fixture(scope="module")
def reference():
    example = example_namespace(SNIPPET)
    torch.manual_seed(example["SEED"])
    vocab = example["VOCAB"]
    batches = (example["batch"](step) for step in range(example["STEPS"]))
    return train_in_one_process(
        example["TiedLM"](), ((t[:, :-1], t[:, 1:]) for t in batches),
        lambda logits, targets: F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)),
        example["LR"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_in_a_running_forward_cannot_free(world_size, reference, expect_output):
    losses, grads = reference
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        failed = got["gathered in forward"]
        assert failed["error"].startswith(CANNOT_FREE), failed["error"]
        assert ACTIVE in failed["error"] and "'active_sub_modules': {0}" in failed["error"]
        assert len(failed["losses"]) == 1  # step 0 ran; step 1 raised at the end of the block
        assert_matches(failed["losses"], losses[:1], f"rank {rank} step 0 loss")
        assert_matches(failed["grads"][0], grads[0], f"rank {rank} step 0 grads")
        for case in ("gathered around forward", "fix: no gather"):
            assert got[case]["error"] is None, got[case]["error"]
            assert_same_training(got[case], (losses, grads), f"{case}, rank {rank}")
        # The gather does not keep the weights whole: the module hooks release them inside it.
        every_weight = ["embeddings.weight", "layer.weight", "layer.bias"]
        assert got["gathered around forward"]["released in the block"] == [every_weight] * 3
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 4 samples split 2/1/1 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 4 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
