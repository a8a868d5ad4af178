"""Fault injection: every way a rank can fail ends the run promptly, says who failed and why, and leaves nothing running.

Each case is a purpose-made script in rankrun/tests/cases/, run in the warm pool; the cases
where fresh processes take another code path (a timeout, a rank's own exit code) run in fresh
processes too. For each: the run ends within a bound (the grace period or the timeout,
plus a few seconds), the report names the snippet, the ranks and the cause, and no process
the run started is alive afterwards (checked by process id and process group).
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rankrun import launch, pool, project, runner
from rankrun.processes import alive, interruptible
from rankrun.runner import ROOT, SnippetFailed, run_snippet

pytestmark = pytest.mark.slow  # checks of the runner, not of an example

CASES = Path(__file__).parent / "cases"
# The test sessions these tests start run cases that need torch only: their zygotes import just
# that (rank_main.warm_imports), so a session starts in seconds, not in the 20 s that importing
# DeepSpeed and Transformers takes on a loaded machine. What is tested (processes, signals,
# files) does not depend on what the zygote imported.
LIGHT = {"RANKRUN_WARM_IMPORTS": "torch.distributed"}
GRACE = 1.0  # the default is 3 s; the bounds below are stated relative to it
SLACK = 5.0  # seconds on top of the grace period or the timeout



# case, timeout, the report's rank lines, the run's `errors`, whether it times out
# (the ids of cases also run in fresh processes are in ALSO_FRESH)
FAULTS = [
    pytest.param(
        "raise_before_collective", 60,
        ["rank 0: KeyError: 'no such config key'", "rank 1: killed by the runner"],
        ["KeyError: 'no such config key'"], False, id="raises-before-any-collective"),
    pytest.param(
        "raise_on_rank1", 60,
        ["rank 1: ValueError: rank 1 gave up"],
        ["ValueError: rank 1 gave up"], False, id="raises-while-others-wait-in-a-collective"),
    pytest.param(
        "hang_on_rank1", 2,
        ["rank 0: killed by the runner", "rank 1: killed by the runner"],
        [], True, id="hangs-forever"),
    pytest.param(
        "exit_abruptly", 60,
        ["rank 1: exited with code 3"],
        ["rank 1 exited with code 3"], False, id="exits-abruptly"),
    pytest.param(
        "killed_by_signal", 60,
        ["rank 1: killed by signal SIGKILL"],
        ["rank 1 killed by signal SIGKILL"], False, id="killed-by-a-signal"),
    pytest.param(
        "syntax_error", 60,
        ["rank 0: SyntaxError: invalid syntax (syntax_error.py, line 2)",
         "rank 1: SyntaxError: invalid syntax (syntax_error.py, line 2)"],
        ["SyntaxError: invalid syntax (syntax_error.py, line 2)"], False, id="syntax-error"),
]


# Fresh processes differ from the pool in how ranks start, end and are killed: a timeout
# (killed by the runner) and a rank that exits on its own while its peer waits (its exit
# code, then fail-fast) cover those paths; the other causes are reported the same way.
ALSO_FRESH = {"hangs-forever", "exits-abruptly"}
FAULTS_AND_MODES = [
    pytest.param(*fault.values, fresh, id=f"{fault.id}-{'fresh' if fresh else 'pool'}")
    for fault in FAULTS for fresh in (False, True) if not fresh or fault.id in ALSO_FRESH
]


@pytest.mark.parametrize("case, timeout, rank_lines, errors, times_out, fresh", FAULTS_AND_MODES)
def test_fault_ends_the_run_and_names_rank_and_cause(case, timeout, rank_lines, errors, times_out, fresh):
    result = run_snippet(CASES / f"{case}.py", world_size=2, timeout=timeout, grace=GRACE, fresh=fresh)
    assert not result.ok
    assert result.timed_out == times_out
    if times_out:
        assert timeout <= result.seconds < timeout + SLACK
    else:  # the first failure ends the run within the grace period (start-up time is not the runner's)
        ended_after = result.seconds - result.first_failure_seconds
        assert ended_after < GRACE + SLACK, f"ran {ended_after:.1f}s after the first failure"
        assert result.seconds < timeout
    report = result.failure_report()
    assert report.startswith(f"rankrun/tests/cases/{case}.py failed on 2 ranks")
    for line in rank_lines:
        assert line in report, report
    assert result.errors == errors
    if times_out:
        assert f"timed out after {timeout}s" in report
    for rank in result.ranks:
        if rank.exception:  # the traceback of every rank that raised first is in the report
            assert rank.rank not in result.failed_first or rank.exception["traceback"].rstrip() in report
    with pytest.raises(SnippetFailed):
        result.check()
    assert not any(alive(rank.pid) for rank in result.ranks)


def test_children_of_a_hung_rank_die_with_it():
    result = run_snippet(CASES / "hang_with_child.py", world_size=2, timeout=2)
    assert result.timed_out
    children = [int(pid) for pid in re.findall(r"^child (\d+)$", result.output, re.M)]
    assert len(children) == 2
    assert not any(alive(pid) for pid in children + [rank.pid for rank in result.ranks])


def test_the_pool_is_healthy_after_a_fault():
    failed = run_snippet(CASES / "raise_on_rank1.py", world_size=2)
    assert not failed.ok
    after = run_snippet(CASES / "hello.py", world_size=2).check()
    assert after.output == "[rank 0] world 2 local 0 sum 3\n[rank 1] world 2 local 1 sum 3\n"
    assert not {rank.pid for rank in after.ranks} & {rank.pid for rank in failed.ranks}


@pytest.fixture
def taken_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_taken_port_is_retried_once_with_another(taken_port, monkeypatch):
    ports = iter([taken_port, project.free_port()])
    monkeypatch.setattr(project, "free_port", lambda: next(ports))
    result = run_snippet(CASES / "hello.py", world_size=2, grace=GRACE).check()
    assert result.port != taken_port
    assert "EADDRINUSE" in result.retried_because and "rank 0: DistNetworkError" in result.retried_because
    runner.close_pools()
    assert not any(alive(rank.pid) for rank in result.ranks)


def test_a_port_that_stays_taken_is_a_clear_error(taken_port, monkeypatch):
    monkeypatch.setattr(project, "free_port", lambda: taken_port)
    result = run_snippet(CASES / "hello.py", world_size=2, grace=GRACE)
    assert not result.ok and result.port == taken_port and result.retried_because
    assert result.errors == [
        f"DistNetworkError: The server socket has failed to listen on any local network address. "
        f"port: {taken_port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
    ]
    assert not any(alive(rank.pid) for rank in result.ranks)


# A test session in miniature: run hello.py on 2 warm ranks, print the port, the pids of the
# processes the session keeps for the next run (the spare pool's two ranks and the zygote that
# forked them) and the output, then wait until its stdin closes.
SESSION = (
    "import sys; from rankrun import runner;"
    "r = runner.run_snippet('rankrun/tests/cases/hello.py', world_size=2).check();"
    "from rankrun import pool; print(r.port); print(*[worker.pid for worker in pool._spares[2].workers], *runner.zygote_pids());"
    "print(r.output, end='', flush=True); sys.stdin.read()"
)


@pytest.fixture(scope="module")
def two_sessions():
    """Two such sessions running at the same time: [(process, port, pids, output lines)]."""
    processes = [subprocess.Popen([sys.executable, "-c", SESSION], cwd=ROOT, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, **LIGHT}) for _ in range(2)]
    try:
        sessions = []
        for process in processes:
            port = int(process.stdout.readline())
            pids = [int(pid) for pid in process.stdout.readline().split()]
            sessions.append((process, port, pids, [process.stdout.readline().rstrip("\n") for _ in range(2)]))
        yield sessions
    finally:
        for process in processes:
            process.kill()
            process.wait()


def wait_until_gone(pids, seconds=10.0):
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(pid) for pid in pids)


def test_two_test_runs_at_the_same_time(two_sessions):
    (first, first_port, first_pids, first_output), (second, second_port, second_pids, second_output) = two_sessions
    assert first_port != second_port
    for output in (first_output, second_output):
        assert output == ["[rank 0] world 2 local 0 sum 3", "[rank 1] world 2 local 1 sum 3"]
    assert len(first_pids) == len(second_pids) == 3  # two spare ranks and a zygote each
    assert not set(first_pids) & set(second_pids)  # each session has its own
    assert all(alive(pid) for pid in first_pids)
    first.stdin.close()  # the first session ends normally
    assert first.wait(timeout=30) == 0
    assert wait_until_gone(first_pids)  # its pool and zygote ended with it
    if second.poll() is None:  # (unless the test below, run first by --order, killed it)
        assert all(alive(pid) for pid in second_pids)  # the other session's did not


def test_pool_ranks_die_when_the_test_process_is_killed_outright(two_sessions):
    session, _, pids, _ = two_sessions[1]
    assert all(alive(pid) for pid in pids)
    session.kill()  # SIGKILL: no atexit, no finally
    session.wait(timeout=30)
    assert wait_until_gone(pids)


def start_interrupted_session(tmp_path, fresh: bool):
    """A child pytest session running a snippet that hangs; returns it once its ranks run."""
    pids_file = tmp_path / "pids"
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, **LIGHT, "PIDS_FILE": str(pids_file), "RUN_FRESH": "1" if fresh else "0",
           "TMPDIR": str(tmp_path / "tmp")}
    session = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES / "interrupted_session.py")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=interruptible,
    )
    deadline = time.monotonic() + 120
    while not (pids_file.exists() and len(pids_file.read_text().split()) == 4):
        assert session.poll() is None, session.stdout.read()
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.1)
    return session, [int(pid) for pid in pids_file.read_text().split()]  # two ranks and their children


def test_a_rank_not_yet_in_a_group_of_its_own_is_killed_all_the_same():
    """A pool worker the zygote forked a moment ago has not called setsid yet: killing its group
    finds none. It is killed alone; left alive, it would wait for a job forever and the runner
    closing the pool for it (seen: a spare pool closed right after it was forked)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # our group
    launch.kill_group(process, wait=False)
    assert process.wait(timeout=30) == -signal.SIGKILL


def test_spare_pools_closed_as_soon_as_they_are_forked_close():
    def fork_and_close():
        for _ in range(5):
            pool.RankPool(2).close()

    closing = threading.Thread(target=fork_and_close, daemon=True)
    closing.start()
    closing.join(timeout=120)
    assert not closing.is_alive(), "a pool closed at once waited for a worker forever"


def test_a_command_started_interruptible_takes_ctrl_c_when_the_suite_ignores_it():
    """A suite started in the background (`cmd &` in a script, nohup) has SIGINT ignored, which
    its children inherit: a Python started so never raises KeyboardInterrupt. The Ctrl-C tests
    start their commands through `interruptible`, which gives SIGINT back its default."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        inherited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        restored = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  preexec_fn=interruptible)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (inherited.stdout, restored.stdout) == ("False\n", "True\n")


@pytest.mark.parametrize("fresh", [False, True], ids=["pool", "fresh"])
def test_ctrl_c_on_the_test_session_leaves_no_rank_behind(tmp_path, fresh):
    session, pids = start_interrupted_session(tmp_path, fresh)
    try:
        assert all(alive(pid) for pid in pids)
        assert [p.name for p in (tmp_path / "tmp").iterdir()] == [f"snippet-tests-{session.pid}"]
        session.send_signal(signal.SIGINT)
        output, _ = session.communicate(timeout=30)
    finally:
        session.kill()
    assert "KeyboardInterrupt" in output
    time.sleep(0.5)
    assert not any(alive(pid) for pid in pids), output
    assert list((tmp_path / "tmp").iterdir()) == []  # its temporary files went with it


def test_the_next_session_removes_what_a_killed_session_left_in_the_temporary_directory(tmp_path):
    session, pids = start_interrupted_session(tmp_path, fresh=False)
    session.kill()  # SIGKILL: it cannot clean up
    session.wait(timeout=30)
    # The ranks and the children they started die with it: the zygote gets
    # SIGTERM when the session dies and kills everything below it.
    assert wait_until_gone(pids)
    left = tmp_path / "tmp" / f"snippet-tests-{session.pid}"
    assert left.is_dir() and any(left.iterdir())  # rank logs, coverage data, ...
    env = {**os.environ, **LIGHT, "TMPDIR": str(tmp_path / "tmp")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                           str(CASES / "interrupted_session.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_zygote_that_dies_while_importing_shows_its_own_output(tmp_path):
    """A broken environment (here: a deepspeed that fails to import) is reported as the
    zygote's own traceback, not as the `ConnectionResetError` the runner met afterwards."""
    (tmp_path / "deepspeed.py").write_text('raise ImportError("cannot import name \'X\' (broken on purpose)")\n')
    script = "from rankrun.runner import run_snippet\nrun_snippet('rankrun/tests/cases/hello.py', 2)\n"
    # The broken deepspeed.py comes first; the zygote imports DeepSpeed first, so it fails at once.
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RANKRUN_WARM_IMPORTS": "deepspeed"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    last = done.stderr.rstrip().splitlines()
    assert "RuntimeError: the rank zygote (the process that imports torch and DeepSpeed once for the warm pool) " \
           "exited with code 1 before it forked a worker. Its output:" in done.stderr
    assert last[-1] == "ImportError: cannot import name 'X' (broken on purpose)"
    assert "ConnectionResetError" not in done.stderr


@pytest.mark.parametrize("fresh", [False, True], ids=["pool", "fresh"])
def test_a_child_forked_by_a_snippet_never_answers_for_its_rank(fresh):
    """A child made with os.fork() that returns from the script (no os._exit) ends there:
    the rank's answer and output are its parent's, and the next run in the pool is whole."""
    result = run_snippet(CASES / "fork_without_exit.py", world_size=2, fresh=fresh).check()
    for rank in (0, 1):
        assert result.ranks[rank].stdout == (
            f"child of rank {rank} returns without os._exit\nrank {rank} parent done\n")
    after = run_snippet(CASES / "hello.py", world_size=2, fresh=fresh).check()
    assert after.output == "[rank 0] world 2 local 0 sum 3\n[rank 1] world 2 local 1 sum 3\n"


@pytest.mark.parametrize("fresh", [False, True], ids=["pool", "fresh"])
def test_a_process_a_snippet_leaves_running_fails_the_run_and_is_killed(fresh):
    """A daemon in a new session and an orphaned sleep outlive the snippet;
    the run fails naming them, and they are gone when run_snippet returns."""
    result = run_snippet(CASES / "leave_a_process.py", world_size=2, fresh=fresh)
    assert not result.ok
    assert result.output == "rank 0 done\nrank 1 done\n"
    assert result.ranks[0].ok and result.ranks[0].left_running == []
    left = result.ranks[1].left_running
    assert sorted(line.split(" ", 1)[1] for line in left) == ["sleep 301", "sleep 302"], left
    assert result.ranks[1].cause().startswith("left a process running: ")
    assert f"rank 1: left a process running: {left[0]}; {left[1]}" in result.failure_report()
    assert not any(alive(int(line.split()[0])) for line in left)


def seconds_to_start_a_rank() -> float:
    """How long a new interpreter takes here, now, to import what hang_on_rank1.py imports."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch, torch.distributed"], check=True, timeout=300)
    return time.monotonic() - started


@pytest.mark.parametrize("fresh", [False, True], ids=["pool", "fresh"])
def test_a_hung_run_shows_where_each_rank_was(fresh):
    """Before it kills hung ranks the runner asks each for its Python stack: rank 0
    waits in all_reduce (line 11), rank 1 loops in the snippet (line 10)."""
    # Fresh processes import torch first (7 s and more on a loaded machine): the timeout is what
    # that takes on this machine now, measured, plus a margin, instead of a fixed 40 s.
    timeout = 2 * seconds_to_start_a_rank() + 2 if fresh else 3
    result = run_snippet(CASES / "hang_on_rank1.py", world_size=2, timeout=timeout, fresh=fresh)
    assert result.timed_out and all(rank.killed_by_runner for rank in result.ranks)
    report = result.failure_report()
    snippet = str(CASES / "hang_on_rank1.py")
    rank0 = report.split("--- rank 0: where it was when the runner killed it ---\n")[1].split("--- rank 1")[0]
    rank1 = report.split("--- rank 1: where it was when the runner killed it ---\n")[1]
    assert re.search(r'File ".*/torch/distributed/distributed_c10d.py", line \d+ in all_reduce\n', rank0), report
    assert f'File "{snippet}", line 11 in <module>' in rank0, report
    assert rank1.splitlines()[1:] == [f'  File "{snippet}", line 10 in <module>'], report
    assert "rank_main.py" not in rank0 + rank1 and "<frozen runpy>" not in rank0 + rank1  # the runner's frames


def test_fresh_ranks_die_when_the_test_process_is_killed_outright(tmp_path):
    """With fresh=True the ranks are the test process's own children: they get SIGKILL when it
    dies (PR_SET_PDEATHSIG). What they started is not covered (see docs/testing.md)."""
    session, pids = start_interrupted_session(tmp_path, fresh=True)
    ranks, children = pids[0::2], pids[1::2]
    session.kill()
    session.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(runner.process_exists(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(runner.process_exists(pid) for pid in ranks)  # (alive() would see their children)
    for pid in children:  # cleaned up here, not by the runner
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
