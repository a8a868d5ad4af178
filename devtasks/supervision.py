"""Running a command's child to its own end, and ending what it leaves behind.

Every command runs a child (pytest, mkdocs, pip, npm, JupyterLab). Ctrl-C at the terminal reaches
every process of the foreground job, the child included, and the child ends in its own way:
pytest prints its summary and removes its temporary files, mkdocs stops its server. So tasks.py
does not stop or kill it (subprocess.run kills its child a quarter of a second after a
KeyboardInterrupt): it waits for it. A signal sent to tasks.py alone (`kill -INT`, a CI timeout's
SIGTERM) is passed on to the child, which then ends the same way. What the child leaves running
(a notebook kernel in a session of its own) and on disk (in the command's temporary directory)
is ended and removed when the command ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from devtasks.checkout import ROOT

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SI_KERNEL = 0x80  # siginfo si_code of a signal the terminal sent to the whole job
interrupted = False  # a SIGINT arrived while a child ran


def run_child(command: list[str], **options) -> int:
    """Run `command` and wait for it to end, however it is interrupted; its exit status, or
    128 + N when it was killed by signal N (as a shell reports it)."""
    global interrupted
    watched = {signal.SIGCHLD, *FORWARDED}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, watched)  # the child gets them unblocked:
    try:                                                          # see preexec_fn
        process = subprocess.Popen(command, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK, before),
                                   **options)
        while process.poll() is None:
            info = signal.sigtimedwait(watched, 0.5)
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            interrupted |= info.si_signo == signal.SIGINT
            if info.si_code != SI_KERNEL:
                process.send_signal(info.si_signo)
        end_what_is_left()
        while (info := signal.sigtimedwait(FORWARDED, 0)) is not None:  # came as it ended
            interrupted |= info.si_signo == signal.SIGINT
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return process.returncode if process.returncode >= 0 else 128 - process.returncode


def become_subreaper() -> None:
    """Processes the child leaves behind become this process's children, not init's (Linux):
    a notebook kernel runs in a session of its own, which no Ctrl-C at the terminal reaches,
    and its cell's run went on for half a minute after the build that started it was gone."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def children() -> list[tuple[int, str]]:
    """(pid, state) of this process's children, from /proc; none where there is no /proc."""
    found = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == os.getpid():
                found.append((int(entry.name), fields[0]))
    return found


def end_what_is_left(grace: float = 5.0) -> None:
    """End the processes the child left behind (they are ours: become_subreaper): SIGTERM,
    then SIGKILL after `grace` seconds; what they leave in turn is ended the same way."""
    signalled: dict[int, float] = {}
    stop = time.monotonic() + 3 * grace
    while (left := children()) and time.monotonic() < stop:
        for pid, state in left:
            try:
                if state == "Z":
                    os.waitpid(pid, os.WNOHANG)
                elif pid not in signalled:
                    os.kill(pid, signal.SIGTERM)
                    signalled[pid] = time.monotonic()
                elif time.monotonic() - signalled[pid] > grace:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, ChildProcessError):
                pass
        time.sleep(0.05)


def run_step(command: list[str], **options) -> None:
    """An install step: stop (exit 130) if it was interrupted, fail if it failed."""
    code = run_child(command, cwd=options.pop("cwd", ROOT), **options)
    if interrupted:
        raise KeyboardInterrupt
    if code != 0:
        raise subprocess.CalledProcessError(code, command)


# Every temporary file of a command (pytest's session directory, mkdocs serve's site, the
# notebook's run and its torchrun logs, ensurepip's wheels) goes into one directory per
# command, removed when it ends; the next command removes those of commands that were killed.
COMMAND_TMP_PREFIX = "tasks-py-"


@contextlib.contextmanager
def command_temporary_directory() -> Iterator[Path]:
    """TMPDIR, for the command and everything it starts, while it runs (own_temporary_directory)."""
    temporary = own_temporary_directory()
    os.environ["TMPDIR"] = str(temporary)
    tempfile.tempdir = None  # tempfile caches the directory it found first
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def own_temporary_directory() -> Path:
    base = Path(tempfile.gettempdir())
    for directory in base.glob(f"{COMMAND_TMP_PREFIX}*"):
        pid = directory.name[len(COMMAND_TMP_PREFIX):]
        if pid.isdigit() and not pid_exists(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)
    directory = base / f"{COMMAND_TMP_PREFIX}{os.getpid()}"
    directory.mkdir(exist_ok=True)
    return directory


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
