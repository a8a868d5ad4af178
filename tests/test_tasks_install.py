"""The install every command starts with (tasks.py, devtasks.install and devtasks.health) under
misuse: an interrupted or concurrent install, a broken environment (a missing version, deleted
files, the project not installed from this checkout), and DeepSpeed's op compiled before the
tests only when it is missing.

The install cases run tasks.py for real in a scratch copy of the project whose
constraints pin only pip itself, so an install there takes seconds, not minutes.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from importlib.metadata import version

import pytest

from devtasks import deepspeed_op, health
from rankrun.runner import ROOT

pytestmark = pytest.mark.slow  # checks of the commands, not of an example

SMALL_PIN = version("iniconfig")  # pinned in constraints.txt, so pip finds it where the real install did


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
    """tasks.py and devtasks/ with a tiny project beside them: installing it only needs what is on disk."""
    shutil.copy(ROOT / "tasks.py", tmp_path / "tasks.py")
    shutil.copytree(ROOT / "devtasks", tmp_path / "devtasks", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "constraints.txt").write_text(f"iniconfig=={SMALL_PIN}\nsetuptools=={version('setuptools')}\n")
    (tmp_path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "scratch"\nversion = "0"\n[project.optional-dependencies]\ntest = []\n'
        '[project.entry-points.pytest11]\nscratch = "scratchpkg.plugin"\n'
        '[tool.setuptools]\npackages = ["scratchpkg"]\n'
    )
    (tmp_path / "scratchpkg").mkdir()
    (tmp_path / "scratchpkg" / "__init__.py").write_text("")
    (tmp_path / "scratchpkg" / "plugin.py").write_text("")
    vendor = ROOT / "docs" / "assets" / "vendor"
    shutil.copytree(vendor, tmp_path / "docs" / "assets" / "vendor", symlinks=False)
    # The scratch project installs one small pinned distribution instead of torch and deepspeed,
    # then itself (editable, with its entry point); every other line of tasks.py and devtasks/ is
    # the real one.
    text = (tmp_path / "devtasks" / "install.py").read_text()
    for step, instead in (('pip_install("torch", "setuptools")', 'pip_install("iniconfig", "setuptools")'),
                          ('pip_install("--no-build-isolation", "deepspeed")', 'pass'),
                          ('pip_install("--no-build-isolation", "-e", ".[test,lint,notebook,transformers]")',
                           'pip_install("--no-build-isolation", "-e", ".[test]")')):
        assert step in text, step
        text = text.replace(step, instead)
    (tmp_path / "devtasks" / "install.py").write_text(text)
    return tmp_path


def run_tasks(project: Path, *args: str, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tasks.py", *args], cwd=project, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_an_install_interrupted_while_creating_the_environment_is_redone(scratch_project, tmp_path):
    # Ctrl-C while venv.create is still running (ensurepip): it ends, and leaves no file of its own.
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    install = subprocess.Popen([sys.executable, "tasks.py", "install"], cwd=scratch_project,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(temporary)})
    deadline = time.monotonic() + 120
    while not any(temporary.rglob("tmp*")) and time.monotonic() < deadline:  # ensurepip's, with its wheels
        time.sleep(0.05)
    assert (scratch_project / ".venv" / "bin" / "python").exists()
    install.send_signal(signal.SIGINT)
    _, err = install.communicate(timeout=60)
    assert install.returncode == 130, err
    assert err.endswith("tasks.py: interrupted\n"), err
    venv = scratch_project / ".venv"
    assert venv.exists() and not (venv / ".created").exists()  # a half-made environment was left
    assert list(temporary.iterdir()) == []  # ensurepip's copy of the wheels went with it

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


def test_the_health_check_names_missing_and_mismatched_distributions(tmp_path, monkeypatch):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("pytest==0.0.1\nno-such-distribution==1.0\n# a comment\ntorch==2.13.0\n")
    monkeypatch.setattr(health, "CONSTRAINTS", constraints)
    problems = health.environment_problems()
    assert problems == [
        f"pytest==0.0.1: found {pytest.__version__}",
        "no-such-distribution==1.0: not installed",
    ]  # torch 2.13.0+cpu matches torch==2.13.0


def test_the_deepspeed_op_is_compiled_before_the_tests_only_when_missing(tmp_path, monkeypatch):
    """`tasks.py test` compiles DeepSpeed's CPU op itself when this environment lacks it (so no
    test's timeout pays the compile), removes a lock a killed build left, and does nothing when
    the op is there."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(deepspeed_op, "run_in_venv", lambda *args: calls.append(args) or 0)
    op = tmp_path / "deepspeed_shm_comm"
    op.mkdir()
    stale = op / "lock"
    stale.write_text("")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    deepspeed_op.build_deepspeed_op()
    assert calls == [("-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()")]
    assert not stale.exists()
    (op / "deepspeed_shm_comm.so").write_bytes(b"")
    deepspeed_op.build_deepspeed_op()
    assert len(calls) == 1  # already compiled: nothing to do


# --- The environment check sees a broken install, not only versions.

def scratch_python(project: Path) -> Path:
    return project / ".venv" / "bin" / "python"


def test_an_uninstalled_project_is_noticed_and_installed_again(installed_scratch_project):
    """Without the project's own install pytest runs without the harness's plugin (its options
    unknown: `'Namespace' object has no attribute '--order'`); the check names it and repairs."""
    project, python = installed_scratch_project, scratch_python(installed_scratch_project)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "scratch"], check=True, capture_output=True)

    repaired = run_tasks(project, "install")
    assert repaired.returncode == 0, repaired.stderr
    assert ("the environment does not match constraints.txt; repairing it:\n"
            "  scratch (this project, pip install -e .): not installed\n") in repaired.stdout
    entry_points = "from importlib.metadata import entry_points; print(entry_points(group='pytest11')['scratch'].value)"
    assert subprocess.run([python, "-I", "-c", entry_points], capture_output=True, text=True).stdout == "scratchpkg.plugin\n"
    assert "repairing" not in run_tasks(project, "install").stdout


def test_a_package_whose_files_are_gone_is_noticed_and_reinstalled(installed_scratch_project):
    """pip keeps a distribution whose files were deleted for installed (its metadata is there):
    the check finds its module missing, and the repair reinstalls it at its pinned version."""
    project, python = installed_scratch_project, scratch_python(installed_scratch_project)
    where = subprocess.run([python, "-c", "import iniconfig; print(iniconfig.__file__)"], capture_output=True,
                           text=True, check=True).stdout.strip()
    shutil.rmtree(Path(where).parent)  # the package's files; iniconfig-*.dist-info stays
    assert subprocess.run([python, "-m", "pip", "show", "-q", "iniconfig"], capture_output=True).returncode == 0

    repaired = run_tasks(project, "install")
    assert repaired.returncode == 0, repaired.stderr
    assert (f"repairing it:\n  iniconfig=={SMALL_PIN}: installed, but its files are gone (no module 'iniconfig')\n"
            in repaired.stdout)
    assert f"--force-reinstall --no-deps iniconfig=={SMALL_PIN}" in repaired.stdout
    assert subprocess.run([python, "-c", "import iniconfig"]).returncode == 0
    assert "repairing" not in run_tasks(project, "install").stdout


def test_the_project_installed_from_another_checkout_is_noticed_and_installed_from_this_one(
        installed_scratch_project, tmp_path):
    project, python = installed_scratch_project, scratch_python(installed_scratch_project)
    other = tmp_path / "other-checkout"
    shutil.copytree(project, other, ignore=shutil.ignore_patterns(".venv", "*.egg-info", "build"))
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", other],
                   check=True, capture_output=True)

    repaired = run_tasks(project, "install")
    assert repaired.returncode == 0, repaired.stderr
    assert (f"  scratch (this project): scratchpkg.plugin is imported from {os.path.realpath(other)}/scratchpkg/"
            f"__init__.py, not from {os.path.realpath(project)}\n") in repaired.stdout
    where = subprocess.run([python, "-I", "-c", "import scratchpkg; print(scratchpkg.__file__)"], capture_output=True,
                           text=True).stdout
    assert where == f"{os.path.realpath(project)}/scratchpkg/__init__.py\n"


def test_the_health_check_of_the_real_environment_finds_nothing_within_half_a_second():
    """Every command runs the check first. Measured as CPU time (the interpreter's start
    included): on a loaded machine the wall-clock time measures the load."""
    import resource

    def cpu_of_children():
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    times = []
    for _ in range(3):
        before = cpu_of_children()
        assert health.environment_problems() == []
        times.append(cpu_of_children() - before)
    assert sorted(times)[1] < 0.5, times
