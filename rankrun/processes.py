"""The process table: what the runner's tests check to prove nothing was left running."""

import os

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
