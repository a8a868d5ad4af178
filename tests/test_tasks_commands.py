"""The two commands (tasks.py) under misuse: an interrupted or concurrent install, a broken
environment, a taken port, pytest options that turn xdist off, and the coverage gate from tests/.

The install cases run tasks.py for real in a scratch copy of the project whose
constraints pin only pip itself, so an install there takes seconds, not minutes.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from importlib.metadata import version
from types import SimpleNamespace

import pytest

from rankrun import coverage_gate
from rankrun.runner import ROOT

pytestmark = pytest.mark.slow  # checks of the commands, not of an example

SMALL_PIN = version("iniconfig")  # pinned in constraints.txt, so pip finds it where the real install did


def load_tasks():
    spec = importlib.util.spec_from_file_location("tasks", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    return tasks


@pytest.fixture
def scratch_project(tmp_path):
    return make_scratch_project(tmp_path)


@pytest.fixture(scope="module")
def installed_scratch_project(tmp_path_factory):
    """One installed scratch project for the tests that start from a finished install."""
    project = make_scratch_project(tmp_path_factory.mktemp("installed"))
    done = run_tasks(project, "install")
    assert done.returncode == 0, done.stderr
    return project


def make_scratch_project(tmp_path: Path) -> Path:
    """tasks.py with a tiny project beside it: installing it only needs what is on disk."""
    shutil.copy(ROOT / "tasks.py", tmp_path / "tasks.py")
    (tmp_path / "constraints.txt").write_text(f"iniconfig=={SMALL_PIN}\n")
    (tmp_path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "scratch"\nversion = "0"\n[project.optional-dependencies]\ntest = []\n'
        '[tool.setuptools]\npy-modules = []\n'
    )
    vendor = ROOT / "docs" / "assets" / "vendor"
    shutil.copytree(vendor, tmp_path / "docs" / "assets" / "vendor", symlinks=False)
    # The scratch project installs one small pinned distribution instead of torch, deepspeed
    # and the project; every other line of tasks.py is the real one.
    text = (tmp_path / "tasks.py").read_text()
    for step in ('pip_install("torch", "setuptools")', 'pip_install("--no-build-isolation", "deepspeed")',
                 'pip_install("--no-build-isolation", "-e", ".[test,lint,notebook,transformers]")'):
        assert step in text, step
        text = text.replace(step, 'pip_install("iniconfig")')
    (tmp_path / "tasks.py").write_text(text)
    return tmp_path


def run_tasks(project: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tasks.py", *args], cwd=project, capture_output=True,
                          text=True, timeout=timeout)


def test_an_install_interrupted_while_creating_the_environment_is_redone(scratch_project):
    # Ctrl-C one second into the first install: venv.create is still running (ensurepip).
    install = subprocess.Popen([sys.executable, "tasks.py", "install"], cwd=scratch_project,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (scratch_project / ".venv" / "bin" / "python").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    install.send_signal(signal.SIGINT)
    install.communicate(timeout=60)
    assert install.returncode != 0
    venv = scratch_project / ".venv"
    assert venv.exists() and not (venv / ".created").exists()  # a half-made environment was left

    again = run_tasks(scratch_project, "install")
    assert again.returncode == 0, again.stderr
    assert "was left half-made by an interrupted install; creating it again" in again.stdout
    assert subprocess.run([venv / "bin" / "python", "-m", "pip", "--version"], capture_output=True).returncode == 0
    assert (venv / ".created").exists() and (venv / ".installed-from").exists()


def test_a_second_install_waits_for_the_first_then_finds_it_done(installed_scratch_project):
    scratch_project = installed_scratch_project
    with open(scratch_project / ".venv.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # an install in progress
        second = subprocess.Popen([sys.executable, "tasks.py", "install"], cwd=scratch_project,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2)
        assert second.poll() is None  # waiting, not installing alongside
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert "another install of .venv is running; waiting for it" in err
    assert "+ -m pip install" not in out  # the first one finished it


def test_a_broken_environment_is_repaired_before_the_command_runs(installed_scratch_project):
    scratch_project = installed_scratch_project
    python = scratch_project / ".venv" / "bin" / "python"
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "iniconfig"], check=True, capture_output=True)

    repaired = run_tasks(scratch_project, "install")
    assert repaired.returncode == 0, repaired.stderr
    assert (f"the environment does not match constraints.txt; repairing it:\n  iniconfig=={SMALL_PIN}: not installed"
            in repaired.stdout)
    assert subprocess.run([python, "-c", "import iniconfig"]).returncode == 0
    assert "repairing" not in run_tasks(scratch_project, "install").stdout  # healthy now: nothing to do


def test_the_health_check_names_missing_and_mismatched_distributions(tmp_path):
    tasks = load_tasks()
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("pytest==0.0.1\nno-such-distribution==1.0\n# a comment\ntorch==2.13.0\n")
    tasks.CONSTRAINTS = constraints
    problems = tasks.environment_problems()
    assert problems == [
        f"pytest==0.0.1: found {pytest.__version__}",
        "no-such-distribution==1.0: not installed",
    ]  # torch 2.13.0+cpu matches torch==2.13.0


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


@pytest.mark.parametrize("args, workers", [
    (["--quick"], ["-n", str(os.cpu_count() or 1), "--dist", "loadfile"]),
    (["--quick", "-p", "no:xdist"], []),
    (["-pno:xdist"], []),
    (["-n", "0"], []),
])
def test_pytest_arguments_pass_workers_only_when_xdist_is_on(args, workers):
    arguments = load_tasks().pytest_arguments(args)
    assert ("-n" in arguments and arguments[:4] == workers) or (not workers and "--dist" not in arguments)


def gate_config(invocation_dir: Path, args: list[str], source=pytest.Config.ArgsSource.ARGS, **options):
    values = {"snippet_coverage": None, "collectonly": False, "keyword": "", "markexpr": "", **options}
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


def test_the_deepspeed_op_is_compiled_before_the_tests_only_when_missing(tmp_path, monkeypatch):
    """`tasks.py test` compiles DeepSpeed's CPU op itself when this environment lacks it (so no
    test's timeout pays the compile), removes a lock a killed build left, and does nothing when
    the op is there."""
    tasks = load_tasks()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(tasks, "run_in_venv", lambda *args: calls.append(args) or 0)
    op = tmp_path / "deepspeed_shm_comm"
    op.mkdir()
    stale = op / "lock"
    stale.write_text("")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    tasks.build_deepspeed_op()
    assert calls == [("-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()")]
    assert not stale.exists()
    (op / "deepspeed_shm_comm.so").write_bytes(b"")
    tasks.build_deepspeed_op()
    assert len(calls) == 1  # already compiled: nothing to do
