"""Loaded by every Python process of a suite `torchrun` run (rankrun.runner.run_torchrun puts
this folder on PYTHONPATH): when the interpreter starts to exit, and torch is loaded, a fatal
signal (SIGABRT: `terminate called without an active exception`) makes the process print
every thread's C++ stack (c10's handler), so a rank that aborts at exit says where."""
import atexit
import sys


def _print_stacks_on_fatal_signal():
    torch = sys.modules.get("torch")
    if torch is not None:
        torch._C._set_print_stack_traces_on_fatal_signal(True)


atexit.register(_print_stacks_on_fatal_signal)


from rankrun.project import SITECUSTOMIZE_CHAIN  # noqa: E402

exec(SITECUSTOMIZE_CHAIN)  # then the sitecustomize this one shadows, as the others do
