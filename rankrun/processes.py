"""The process table: what the runner's tests check to prove nothing was left running, and how
they start a command that they then interrupt."""

import os
import signal

import psutil


def alive(pid):
    """True if `pid`, or any process in its process group, still exists (zombies count as gone)."""
    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if process.pid == pid or os.getpgid(process.pid) == pid:
                return True
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return False


def still_running(processes: list) -> list:
    """The processes of `processes` that run and are not zombies; one that exits while it is
    asked about is gone."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.Error:
            continue
    return running


def command_line(process) -> list[str]:
    """A process's command line; [] for one that exited since it was listed (short-lived
    children come and go while a command starts)."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def interruptible() -> None:
    """preexec_fn of a command a test interrupts: SIGINT and SIGQUIT back to their defaults, as in
    a terminal. A runner that starts the suite in the background (`cmd &` in a script, nohup)
    leaves them ignored, children inherit that, and a Python started with SIGINT ignored never
    turns it into KeyboardInterrupt: Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
