"""The multi-rank runner: torchrun-style environment, per-rank results, fail fast, no leftovers."""

import os
from pathlib import Path

import pytest

from rankrun.processes import alive
from rankrun.runner import SnippetFailed, run_snippet

pytestmark = pytest.mark.slow  # checks of the runner, not of an example

CASES = Path(__file__).parent / "cases"


def test_ranks_get_torchrun_environment_and_report_what_they_print():
    result = run_snippet(CASES / "hello.py", world_size=3).check()
    assert result.output == "".join(f"[rank {r}] world 3 local {r} sum 6\n" for r in range(3))
    assert [rank.exit_code for rank in result.ranks] == [0, 0, 0]


def test_call_returns_each_ranks_value():
    result = run_snippet(CASES / "hello.py", world_size=2, call="main").check()
    assert [result.returned(r) for r in range(2)] == [{"rank": 0, "sum": 3.0}, {"rank": 1, "sum": 3.0}]


def test_missing_snippet_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no snippet file at .*does_not_exist.py"):
        run_snippet("snippets/does_not_exist.py")


def test_every_run_gets_new_warm_ranks():
    first = run_snippet(CASES / "hello.py", world_size=2).check()
    second = run_snippet(CASES / "hello.py", world_size=2).check()
    assert not {r.pid for r in first.ranks} & {r.pid for r in second.ranks}  # one run per process
    assert not any(alive(r.pid) for r in first.ranks + second.ranks)  # and they ended with it
    assert second.output == first.output == "[rank 0] world 2 local 0 sum 3\n[rank 1] world 2 local 1 sum 3\n"


def test_a_snippet_that_leaves_state_behind_does_not_change_the_next_one():
    in_fresh_processes = run_snippet(CASES / "probe_state.py", world_size=2, fresh=True).check()
    assert "partitioned weight shape: (0,) full: (4, 4)" in in_fresh_processes.output
    assert "sibling counter: 0" in in_fresh_processes.output
    # Like torchrun: one OpenMP thread per rank unless the caller set OMP_NUM_THREADS.
    assert f"threads: {os.environ.get('OMP_NUM_THREADS', '1')}\n" in in_fresh_processes.output
    assert not any(alive(rank.pid) for rank in in_fresh_processes.ranks)  # fresh processes end with their run
    polluter = run_snippet(CASES / "leave_state_behind.py", world_size=2).check()
    assert polluter.output.startswith("left state behind\n")
    assert not {r.pid for r in in_fresh_processes.ranks} & {r.pid for r in polluter.ranks}
    after_polluter = run_snippet(CASES / "probe_state.py", world_size=2).check()
    assert after_polluter.output == in_fresh_processes.output
    # What a reused worker used to pass on (each line as a fresh process has it).
    for line in ["sys.stdout is the real one: True", "relu of 1: 1.0", "print precision: 4",
                 "matmul precision: highest", "umask: 0o22", "recursion limit: 1000",
                 "deepspeed logger level: 0 root logger level: 30", "global forward hooks: 0",
                 "anomaly detection: False", "open files limit: True", "SIGUSR2 handler is the default: True",
                 "SIGHUP blocked: False"]:
        assert after_polluter.output.count(line + "\n") == 2, line
    assert "still prints" not in after_polluter.output


def test_a_failure_report_names_the_pages_that_show_the_snippet():
    """Like Sybil pointing at the document: the second line of the report says where the
    failing snippet is shown (this example fails on purpose)."""
    result = run_snippet("snippets/zero3/soft_inputs_outside.py", world_size=2)
    assert not result.ok
    assert result.failure_report().splitlines()[1] == "shown on docs/zero3/outside-forward.md"


def test_a_rank_the_runner_killed_is_a_failed_rank_whatever_its_exit_status():
    """A pool worker whose job ended on its peer's death, between the runner's kills, exits with
    status 0 itself: it is still a rank the runner killed, listed with where it was."""
    from rankrun.results import RankResult, RunResult

    stack = 'Thread 0x00007f0000000001 (most recent call first):\n  File "deadlock.py", line 9 in <module>'
    ranks = [RankResult(rank=r, pid=100 + r, exit_code=code, stdout="", stderr=stack, killed_by_runner=True)
             for r, code in enumerate((-9, 0))]
    result = RunResult(snippet=Path("deadlock.py"), world_size=2, ranks=ranks, seconds=2.5, timed_out=True,
                       timeout=2.0, failed_first=[], port=0, first_failure_seconds=None)
    assert not ranks[1].ok and not result.ok
    report = result.failure_report()
    for rank in (0, 1):
        assert f"rank {rank}: killed by the runner" in report
        assert f"--- rank {rank}: where it was when the runner killed it ---" in report
