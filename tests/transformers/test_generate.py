"""snippets/transformers/generate.py: generate() under ZeRO-3 on 2 and 4 ranks, the ranks
stopping after different numbers of tokens. Left to Transformers (HfDeepSpeedConfig alive) and
with synced_gpus=True, every rank's tokens equal the same model's in one process; with
synced_gpus=False the ranks hang: the runner declares it once every rank has waited in a
collective with no progress for HANG.quiet seconds (rankrun.hang), and shows the ranks' stacks."""

import re

import pytest

from rankrun import marks
from rankrun.hang import HangTranscript, HangWatch, frames_shown
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import ROOT, printed_by_the_example, run_snippet

SNIPPET = "snippets/transformers/generate.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
# The hang: every rank blocked in a collective, none with a stack change, output or CPU use,
# for 5 s; a generate step here takes a fraction of a second on a loaded machine (the failure
# report gives the longest wait of the run that went on).
HANG = HangWatch(quiet=5.0)
EXAMPLE = example_namespace(SNIPPET)


def one_process(rank):
    """The same model and prompt, greedy, in this one process without DeepSpeed."""
    model = EXAMPLE["tiny_llama"]().eval()
    output = model.generate(EXAMPLE["prompt"](rank), max_new_tokens=EXAMPLE["new_tokens"](rank),
                            do_sample=False, pad_token_id=0)
    return output[0, EXAMPLE["PROMPT"]:].tolist()


@pytest.mark.parametrize("world_size", [2, 4])
def test_generate_on_ranks_that_stop_apart_equals_one_process(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        want = one_process(rank)
        assert len(want) == EXAMPLE["new_tokens"](rank)
        assert result.returned(rank) == {"default": want, "synced": want}, rank
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


HANG_FILE = ROOT / "snippets/transformers/generate_hang.txt"
# The frames of a rank's stack that say where it waits (innermost last), in the snippet,
# Transformers' generate loop, DeepSpeed's gather and torch.distributed.
SHOWN = re.compile(r'File ".*?(snippets/transformers/generate\.py|transformers/generation/utils\.py|'
                   r'deepspeed/runtime/zero/partitioned_param_coordinator\.py|'
                   r'torch/distributed/distributed_c10d\.py)", line \d+ in (\w+)')


def waiting_in(stack):
    return frames_shown(stack, SHOWN)


@marks.hang
@pytest.mark.parametrize("world_size", [2, 4])
def test_synced_gpus_false_hangs(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="unsynced", timeout=TIMEOUT, hang=HANG)
    assert result.hung and not result.timed_out, result.failure_report()
    first = min(EXAMPLE["new_tokens"](rank) for rank in range(world_size))
    for rank in result.ranks:
        assert rank.killed_by_runner and rank.stack, result.failure_report()
        where = waiting_in(rank.stack)
        if EXAMPLE["new_tokens"](rank.rank) == first:  # done generating, waits in the barrier
            assert where == [("generate.py", "unsynced"), ("distributed_c10d.py", "barrier")], where
            assert printed_by_the_example(rank.stdout) == f"[rank {rank.rank}] synced_gpus=False: {one_process(rank.rank)}\n"
        else:  # still generating: waits for the finished rank's share of a weight
            assert where[:4] == [("generate.py", "unsynced"), ("generate.py", "generate"),
                                 ("utils.py", "generate"), ("utils.py", "_sample")], where
            assert ("partitioned_param_coordinator.py", "fetch_sub_module") in where, where
            assert printed_by_the_example(rank.stdout) == ""
    if world_size == 2:
        expect_output(HangTranscript(result, HANG, SHOWN), HANG_FILE)
