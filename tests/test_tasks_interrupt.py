"""Interrupting the commands (tasks.py, devtasks.supervision): Ctrl-C at a real pseudo-terminal,
and a SIGINT to tasks.py alone, while pytest or the site's notebook runs. The child ends in its
own way, and nothing it started is left running or on disk.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rankrun.processes import command_line, interruptible, still_running
from rankrun.runner import ROOT

pytestmark = pytest.mark.slow  # checks of the commands, not of an example


WAITING_TESTS = '''
import os, time
from pathlib import Path

def test_passes():
    pass

def test_waits():
    Path(os.environ["WAITING_FILE"]).write_text("")
    time.sleep(120)
'''


def start_waiting_session(tmp_path: Path, workers: str, terminal: bool):
    """`tasks.py test -n <workers>` on a test that waits, in this checkout; returns it once the
    test waits. With `terminal`, it runs on a pseudo-terminal of its own, as in a shell."""
    (tmp_path / "case").mkdir()
    (tmp_path / "case" / "test_waiting.py").write_text(WAITING_TESTS)
    (tmp_path / "tmp").mkdir()
    waiting = tmp_path / "waiting"
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "WAITING_FILE": str(waiting)}
    command = [sys.executable, "tasks.py", "test", "-n", workers, "-p", "no:cacheprovider", str(tmp_path / "case")]
    if terminal:
        import pty
        import termios

        main_fd, terminal_fd = pty.openpty()
        session = subprocess.Popen(command, cwd=ROOT, env=env, stdin=terminal_fd, stdout=terminal_fd,
                                   stderr=terminal_fd, start_new_session=True,
                                   preexec_fn=lambda: (interruptible(), fcntl.ioctl(0, termios.TIOCSCTTY, 0)))
        os.close(terminal_fd)
        session.terminal = main_fd
    else:
        session = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, preexec_fn=interruptible)
    deadline = time.monotonic() + 120
    while not waiting.exists():
        assert session.poll() is None and time.monotonic() < deadline, "the test never started"
        time.sleep(0.05)
    # The other test's result must have reached pytest's terminal before the interrupt, or the
    # summary cannot count it: under load, a worker's report can arrive seconds after the test.
    session.early_output = output_until_a_result(session.terminal if terminal else session.stdout.fileno(),
                                                 session, deadline)
    return session


# pytest's first progress mark after collection: a test's result was reported.
FIRST_RESULT = re.compile(r"2 items.*?(?:^|\s)[.FEsx]+(?:\s|$)", re.S | re.M)
TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def output_until_a_result(fd: int, session, deadline: float) -> str:
    seen = b""
    while not FIRST_RESULT.search(TERMINAL_CODES.sub("", seen.decode(errors="replace"))):
        assert session.poll() is None and time.monotonic() < deadline, (
            "no test result reported: " + seen.decode(errors="replace"))
        if select.select([fd], [], [], 0.1)[0]:
            seen += os.read(fd, 65536)
    return seen.decode(errors="replace")


def read_terminal(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every process of the terminal has closed it
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("workers", ["0", "2"])
def test_sigint_to_tasks_py_lets_pytest_finish_its_session(tmp_path, workers):
    """A SIGINT sent to tasks.py alone (kill -INT, a supervisor) reaches pytest, which ends its
    session as it does on Ctrl-C: its summary, its temporary directory removed; tasks.py waits."""
    import psutil

    session = start_waiting_session(tmp_path, workers, terminal=False)
    below = psutil.Process(session.pid).children(recursive=True)
    session.send_signal(signal.SIGINT)
    try:
        # Generous: a loaded machine (the rest of the suite beside it) slows pytest's teardown.
        output, _ = session.communicate(timeout=180)
    finally:
        session.kill()
    output = session.early_output + output
    assert session.returncode == 2, output  # pytest's exit status for an interrupted session
    assert "KeyboardInterrupt" in output and "1 passed" in output, output
    assert "Traceback" not in output, output
    psutil.wait_procs(below, timeout=10)
    assert not still_running(below)
    assert list((tmp_path / "tmp").iterdir()) == []  # the session's directory went with it


def test_ctrl_c_at_the_terminal_lets_pytest_finish_its_session(tmp_path):
    """Ctrl-C in a terminal reaches tasks.py, pytest and its workers at once: pytest ends its
    session once (tasks.py passes nothing on) and tasks.py waits for it."""
    session = start_waiting_session(tmp_path, "2", terminal=True)
    os.write(session.terminal, b"\x03")  # the terminal sends SIGINT to the foreground job
    try:
        session.wait(timeout=180)  # generous under load, as above
    finally:
        session.kill()
    output = session.early_output + read_terminal(session.terminal)
    assert session.returncode == 2, output
    assert "KeyboardInterrupt" in output and "1 passed" in output, output
    assert "Traceback" not in output, output
    assert list((tmp_path / "tmp").iterdir()) == []


def free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("args", [
    ["serve", "--dev-addr", "127.0.0.1:{port}"],  # NOTEBOOKS_EXECUTE=always: the first build runs the notebook
    ["test", "-n", "0", "-p", "no:cacheprovider", "tests/test_site.py::test_site_builds_strict"],
], ids=["serve", "test"])
def test_ctrl_c_while_the_notebook_runs_leaves_no_process_and_no_file(args):
    """Ctrl-C while the site's notebook executes (a Jupyter kernel in a session of its own, which
    the terminal's signal does not reach, running a 2-rank torchrun): the command ends without
    a traceback, and nothing it started is left running or on disk."""
    import pty
    import termios

    import psutil

    # A short temporary directory, as /tmp is: the kernel's IPC sockets go below it, and a
    # socket's path has at most 107 bytes.
    temporary = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(temporary), "NOTEBOOKS_EXECUTE": "always"}
    main_fd, terminal_fd = pty.openpty()
    command = [sys.executable, "tasks.py", *(arg.format(port=free_local_port()) for arg in args)]
    session = subprocess.Popen(command, cwd=ROOT, env=env, stdin=terminal_fd, stdout=terminal_fd,
                               stderr=terminal_fd, start_new_session=True,
                               preexec_fn=lambda: (interruptible(), fcntl.ioctl(0, termios.TIOCSCTTY, 0)))
    os.close(terminal_fd)
    output = []
    reader = __import__("threading").Thread(target=lambda: output.append(read_terminal(main_fd)), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        started = []
        while not any("torch.distributed.run" in command_line(p) for p in started):  # the cell's run
            assert session.poll() is None and time.monotonic() < deadline, "the notebook never started"
            time.sleep(0.2)
            try:
                started = psutil.Process(session.pid).children(recursive=True)
            except psutil.Error:
                started = []
        time.sleep(2)  # its cell runs
        started = psutil.Process(session.pid).children(recursive=True)
        os.write(main_fd, b"\x03")
        session.wait(timeout=180)  # generous, as above: a loaded machine slows the teardown
    finally:
        session.kill()
    reader.join(timeout=30)
    text = "".join(output)
    assert session.returncode in (1, 2), text  # mkdocs' "Aborted!" during a build; pytest's interrupted session
    assert "Traceback" not in text and "ZMQError" not in text, text
    psutil.wait_procs(started, timeout=15)
    assert [p.pid for p in still_running(started)] == [], text
    left = list(temporary.iterdir())
    shutil.rmtree(temporary)
    assert left == [], text
