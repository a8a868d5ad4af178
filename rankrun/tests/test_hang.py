"""The hang watch (rankrun.hang): ranks that wait for each other are declared hung once the
evidence is complete, in seconds, with each rank's stack in the report; a run that is merely
slow, or a rank stuck outside any collective, is never declared hung."""

from pathlib import Path

import pytest

from rankrun.hang import HangWatch
from rankrun.processes import alive
from rankrun.runner import SnippetFailed, run_snippet

pytestmark = pytest.mark.slow  # checks of the runner, not of an example

CASES = Path(__file__).parent / "cases"
QUIET = 2.0


@pytest.mark.parametrize("fresh", [False, True], ids=["pool", "fresh"])
def test_ranks_waiting_for_each_other_are_declared_hung_after_the_quiet_interval(fresh):
    result = run_snippet(CASES / "deadlock.py", 2, timeout=300, grace=1.0, fresh=fresh, hang=HangWatch(quiet=QUIET))
    assert result.hung and not result.timed_out and not result.ok, result.failure_report()  # not the timeout
    evidence = result.hang_evidence
    assert evidence.quiet >= QUIET and evidence.looks >= QUIET / HangWatch().every, evidence
    report = result.failure_report()
    assert report.startswith("rankrun/tests/cases/deadlock.py failed on 2 ranks after ")
    assert f"hung: every rank blocked in a collective, no stack change, no output and no CPU use" in report
    for rank in result.ranks:
        assert rank.killed_by_runner and rank.stack, report
        assert f"--- rank {rank.rank}: where it was when the runner killed it ---" in report
        assert 'distributed_c10d.py", line ' in rank.stack and 'deadlock.py", line 9 in <module>' in rank.stack
        assert evidence.innermost[rank.rank].startswith("recv (distributed_c10d.py:"), evidence.innermost
        assert rank.stdout == f"[rank {rank.rank}] waiting for rank {1 - rank.rank}\n"
    with pytest.raises(SnippetFailed):
        result.check()
    assert not any(alive(rank.pid) for rank in result.ranks)


def test_a_rank_that_computes_while_its_peer_waits_is_not_a_hang():
    """Even when every frame counts as blocked: rank 1's stack and CPU time change all along."""
    watch = HangWatch(quiet=QUIET, blocked=lambda frames: True)
    result = run_snippet(CASES / "late_peer.py", 2, timeout=120, env={"SECONDS_BUSY": str(2 * QUIET + 1)}, hang=watch)
    assert result.ok and not result.hung, result.failure_report()
    assert result.output == "[rank 0] joined\n[rank 1] joined\n"


def test_a_rank_stuck_outside_any_collective_is_left_to_the_timeout():
    """Rank 1 sleeps in plain Python (hang_on_rank1.py): not ranks waiting for each other."""
    result = run_snippet(CASES / "hang_on_rank1.py", 2, timeout=2 * QUIET + 1, hang=HangWatch(quiet=QUIET))
    assert result.timed_out and not result.hung, result.failure_report()
    assert all(rank.killed_by_runner and rank.stack for rank in result.ranks)
