"""A real torchrun run whose rank aborts at exit is an ordinary failure that shows where.

An abort after all output (`terminate called without an active exception`, SIGABRT) is not
excused: check_torchrun raises as for any failed run, with the C++ stack c10 printed for the
thread the signal hit (rankrun/stacks_at_abort puts that in every suite torchrun run).
"""

from pathlib import Path

import pytest

from rankrun.runner import aborted_thread, check_torchrun, run_torchrun

pytestmark = pytest.mark.slow  # a check of the runner, not of an example

CASE = Path(__file__).parent / "cases" / "abort_at_exit.py"


def test_a_rank_that_aborts_at_exit_fails_the_run_with_its_stack():
    done = run_torchrun(str(CASE), 2, timeout=300)
    assert "rank 1: 2" in done.stdout  # it printed everything first
    with pytest.raises(AssertionError) as failure:
        check_torchrun(done)
    message = str(failure.value)
    assert f"exited with {done.returncode}" in message and done.returncode != 0
    assert "a rank got a fatal signal, this thread first:\nSIGABRT(6), PID: " in message
    stack = aborted_thread(done.stderr)
    assert "frame #" in stack and "abort" in stack, stack
    assert "known abort" not in message


def test_the_aborted_thread_is_the_one_in_terminate():
    stderr = ("SIGABRT(6), PID: 7, Thread 8: \n frame #0: c10::FatalSignalHandler::stacktraceSignalHandler(bool)\n"
              "frame #1: epoll_wait + 0x56\n\n"
              "SIGABRT(6), PID: 7, Thread 9: \n frame #0: c10::FatalSignalHandler::stacktraceSignalHandler(bool)\n"
              "frame #6: std::terminate() + 0x15\nframe #13: PyThread_exit_thread + 0x12\n\n"
              "Aborted\n")
    assert aborted_thread(stderr) == ("SIGABRT(6), PID: 7, Thread 9:\n frame #0: c10::FatalSignalHandler::"
                                      "stacktraceSignalHandler(bool)\nframe #6: std::terminate() + 0x15\n"
                                      "frame #13: PyThread_exit_thread + 0x12")
    assert aborted_thread("no signal here\n") == ""
