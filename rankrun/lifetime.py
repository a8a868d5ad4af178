"""How the processes of a run live and end: a rank adopts what its snippet starts and orphans,
ends with the process that started it, and kills what its snippet left running; the zygote ends
with everything below it. Used by rankrun/rank_main.py, in the rank and zygote processes."""

import os


def left_running() -> list[str]:
    """Kill what the snippet started and left running; describe each as "PID CMD".

    The rank is a child subreaper (become_subreaper), so everything it started is below it,
    also what was started in a new session or whose parent already ended."""
    import psutil

    me = psutil.Process()
    found = []
    for child in me.children(recursive=True):
        try:
            found.append((child, f"{child.pid} {' '.join(child.cmdline()) or child.name()}"))
            child.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs([child for child, _ in found], timeout=5)
    while True:  # reap what was orphaned to this process meanwhile
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    return [description for _, description in found]


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process instead of to init (PR_SET_CHILD_SUBREAPER)."""
    import ctypes

    ctypes.CDLL(None).prctl(36, 1)


def die_with_parent(signum=None) -> None:
    """Get `signum` (SIGKILL by default) when the parent process ends, even if it is killed with
    no chance to clean up."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signum or signal.SIGKILL)  # PR_SET_PDEATHSIG


def end_with_descendants() -> None:
    """Kill every process below this one, then end this one."""
    import psutil

    try:
        for process in psutil.Process().children(recursive=True):
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
    finally:
        os._exit(1)
