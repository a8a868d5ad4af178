"""The commands' command line (tasks.py): mistakes said in one line with exit 2 before any work
(bad or taken addresses, unknown options and commands), --help, the pytest arguments `test`
passes (workers only while xdist is on), and the coverage gate from tests/.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import tasks
from devtasks import suite
from rankrun import coverage_gate
from rankrun.runner import ROOT

pytestmark = pytest.mark.slow  # checks of the commands, not of an example


# --- Command-line mistakes: one line, exit 2, before any work.

def test_serve_on_a_taken_port_says_so_at_once_and_how_to_choose_another():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "tasks.py", "serve", "--dev-addr", f"127.0.0.1:{port}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert time.monotonic() - started < 30  # no build first
    assert f"cannot serve on http://127.0.0.1:{port}/: Address already in use" in done.stderr
    assert "--dev-addr 127.0.0.1:8001" in done.stderr
    assert "Serving the site" not in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, message", [
    (["serve", "--dev-addr", "127.0.0.1:99999"], "--dev-addr 127.0.0.1:99999: the port must be from 1 to 65535, not 99999"),
    (["serve", "--dev-addr=garbage"], "--dev-addr 'garbage' is not host:port (for example 127.0.0.1:8001)"),
    (["serve", "-a", "127.0.0.1:"], "--dev-addr '127.0.0.1:' is not host:port (for example 127.0.0.1:8001)"),
    (["serve", "--dev-addr", "192.0.2.1:8001"], "cannot serve on http://192.0.2.1:8001/: Cannot assign requested address"),
    (["frobnicate"], "unknown command 'frobnicate'; the commands are serve, test, notebook, matrix "
                     "(python3 tasks.py --help says what each does)"),
])
def test_a_mistake_on_the_command_line_is_one_line_and_exit_2(args, message):
    done = subprocess.run([sys.executable, "tasks.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"tasks.py: {message}\n")


def test_help_is_the_usage_and_exit_0_and_no_command_is_exit_2():
    done = subprocess.run([sys.executable, "tasks.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, tasks.__doc__ + "\n", "")
    bare = subprocess.run([sys.executable, "tasks.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (bare.returncode, bare.stdout, bare.stderr) == (2, "", tasks.__doc__ + "\n")


def test_serve_with_an_unknown_option_says_so_before_serving():
    with socket.socket() as probe:  # a free port: the machine may serve something on any fixed one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "tasks.py", "serve", "--dev-addr", f"127.0.0.1:{port}", "--no-such-option"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.endswith("tasks.py: serve: No such option '--no-such-option' "
                                "(python3 tasks.py serve --help lists the options)\n"), done.stderr
    assert "Serving" not in done.stdout and "Traceback" not in done.stderr


# --- What `test` passes to pytest, and the coverage gate pytest then applies.

@pytest.mark.parametrize("args, workers", [
    (["--quick"], ["-n", str(os.cpu_count() or 1), "--dist", "loadfile"]),
    (["--quick", "-p", "no:xdist"], []),
    (["-pno:xdist"], []),
    (["-n", "0"], []),
])
def test_pytest_arguments_pass_workers_only_when_xdist_is_on(args, workers):
    arguments = suite.pytest_arguments(args)
    assert ("-n" in arguments and arguments[:4] == workers) or (not workers and "--dist" not in arguments)


def gate_config(invocation_dir: Path, args: list[str], source=pytest.Config.ArgsSource.ARGS, **options):
    values = {"snippet_coverage": None, "collectonly": False, "keyword": "", "markexpr": "", "changed": False,
              **options}
    return SimpleNamespace(
        getoption=values.__getitem__, args=args, args_source=source,
        invocation_params=SimpleNamespace(dir=invocation_dir),
    )


@pytest.mark.parametrize("where, args, options, on", [
    (ROOT, [], {}, True),  # `pytest` from the root: testpaths
    (ROOT / "tests", [str(ROOT / "tests")], {"markexpr": "not slow"}, True),  # `cd tests && pytest -m "not slow"`
    (ROOT, ["tests"], {}, True),
    (ROOT, ["tests/zero3"], {}, False),
    (ROOT, [], {"keyword": "language_model"}, False),
    (ROOT, [], {"markexpr": "slow"}, False),
    (ROOT, [], {"collectonly": True}, False),
])
def test_the_coverage_gate_is_on_for_the_whole_suite_from_any_directory(where, args, options, on):
    source = pytest.Config.ArgsSource.TESTPATHS if where == ROOT and not args else pytest.Config.ArgsSource.ARGS
    config = gate_config(where, args, source, **options)
    assert coverage_gate.gate_is_on(config) is on
    assert coverage_gate.why_gate(config)[1]  # the report header says why
