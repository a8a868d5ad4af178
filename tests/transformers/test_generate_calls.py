"""snippets/transformers/generate_calls.py: generate() under ZeRO-3 on 2 and 4 ranks that call
it a different number of times, with synced_gpus on (an HfDeepSpeedConfig alive). Samples for
a log on rank 0 alone, and an evaluation set split unevenly, hang: the runner declares it once
every rank has waited in a collective with no progress for HANG.quiet seconds (rankrun.hang),
the rank inside generate() in a collective of DeepSpeed's or Transformers', the others in the
barrier. The fixes (every rank generates; every rank makes as many calls as the busiest, with
padding prompts whose outputs are dropped) return, on every rank, exactly the tokens of the
same model in one process, for an evaluation set of 5 prompts and one of 1 (ranks with none)."""

import re

import pytest

from rankrun import marks
from rankrun.hang import HangTranscript, HangWatch, frames_shown
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import ROOT, printed_by_the_example, run_snippet

SNIPPET = "snippets/transformers/generate_calls.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
HANG = HangWatch(quiet=5.0)  # a generate step here takes a fraction of a second
EXAMPLE = example_namespace(SNIPPET)
HANG_FILE = ROOT / "snippets/transformers/generate_calls_hang.txt"
# The frames of a rank's stack that say where it waits (innermost last).
SHOWN = re.compile(r'File ".*?(snippets/transformers/generate_calls\.py|transformers/generation/utils\.py|'
                   r'deepspeed/runtime/zero/[a-z_]+\.py|deepspeed/runtime/utils\.py|'
                   r'torch/distributed/distributed_c10d\.py)", line \d+ in (\w+)')


def one_process(prompt):
    model = EXAMPLE["tiny_llama"]().eval()
    output = model.generate(prompt, max_new_tokens=EXAMPLE["NEW"], do_sample=False, pad_token_id=0)
    return output[0, EXAMPLE["PROMPT"]:].tolist()


def shares(size, world_size):
    """Each rank's share of an evaluation set of `size` prompts, as own_share() splits it."""
    each, extra = divmod(size, world_size)
    return [each + (rank < extra) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_calling_generate_equally_often_equals_one_process(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    sample = one_process(EXAMPLE["evaluation_set"](1)[0])
    for rank in range(world_size):
        returned = result.returned(rank)
        assert returned["log"] == sample, rank
        for size in EXAMPLE["EVALUATION_SETS"]:
            prompts = EXAMPLE["evaluation_set"](size)
            start = sum(shares(size, world_size)[:rank])
            mine = prompts[start:start + shares(size, world_size)[rank]]
            assert returned[size] == [one_process(prompt) for prompt in mine], (rank, size)
    # the sets are uneven on these rank counts: some ranks made padding calls, some had no prompt
    assert any(0 in shares(size, world_size) for size in EXAMPLE["EVALUATION_SETS"])
    assert all(len(set(shares(size, world_size))) == 2 for size in EXAMPLE["EVALUATION_SETS"])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


def waiting_in(stack):
    return frames_shown(stack, SHOWN)


def assert_hung_where(result, generating, in_generate):
    """`generating`: the ranks still inside generate(); the others wait in the barrier after
    `in_generate`, the snippet's function that called generate() on them, or skipped it."""
    assert result.hung and not result.timed_out, result.failure_report()
    for rank in result.ranks:
        assert rank.killed_by_runner and rank.stack, result.failure_report()
        where = waiting_in(rank.stack)
        if rank.rank in generating:
            assert where[1:4] == [("generate_calls.py", in_generate), ("generate_calls.py", "greedy"),
                                  ("utils.py", "generate")], where
            # innermost: a collective, or the wait on the handle of a ZeRO-3 gather
            assert where[-1][0] == "distributed_c10d.py" or where[-1][1] == "wait", where
        else:
            assert where[1:] == [("generate_calls.py", in_generate), ("distributed_c10d.py", "barrier")], where



@marks.hang
@pytest.mark.parametrize("world_size", [2, 4])
def test_samples_on_rank_zero_alone_hang(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="rank_zero_only", timeout=TIMEOUT, hang=HANG)
    assert_hung_where(result, generating={0}, in_generate="log_samples_on_rank_zero")
    assert all(printed_by_the_example(rank.stdout) == "" for rank in result.ranks)
    if world_size == 2:
        expect_output(HangTranscript(result, HANG, SHOWN), HANG_FILE)


@marks.hang
@pytest.mark.parametrize("world_size", [2, 4])
def test_an_uneven_share_of_prompts_hangs(world_size):
    result = run_snippet(SNIPPET, world_size, call="own_share_only", timeout=TIMEOUT, hang=HANG)
    share = shares(EXAMPLE["EVALUATION_SETS"][0], world_size)
    busiest = {rank for rank in range(world_size) if share[rank] == max(share)}
    assert_hung_where(result, generating=busiest, in_generate="evaluate_own_share")
    for rank in result.ranks:  # the others finished their share and said so
        printed = printed_by_the_example(rank.stdout)
        assert printed == ("" if rank.rank in busiest else f"[rank {rank.rank}] {share[rank.rank]} prompts\n")
