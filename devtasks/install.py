"""Creating `.venv` and installing exactly the versions in `constraints.txt`.

Every command but `matrix` starts here (ensure_environment): the first one creates the
environment, the next ones find it ready (the health check, devtasks.health) or repair it. One
install runs at a time, and an interrupted one is finished or redone by the next command.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from devtasks.checkout import CONSTRAINTS, PYTHON, ROOT, VENV, die, require_python_3_11
from devtasks.health import FILES_GONE, environment_problems
from devtasks.mermaid import ensure_mermaid
from devtasks.supervision import run_step

STAMP = VENV / ".installed-from"
CREATED = VENV / ".created"  # written once venv.create has finished
PACKAGE = Path(__file__).resolve().parent


def install_fingerprint() -> str:
    # What the install is made from: the pins, the project's declaration and the commands' code
    # (tasks.py and this package); a change to any of them runs the install's steps again.
    digest = hashlib.sha256()
    for path in (ROOT / "pyproject.toml", CONSTRAINTS, ROOT / "tasks.py", *sorted(PACKAGE.glob("*.py"))):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def pip_install(*args: str) -> None:
    # Every step goes through the same constraints file: torch can never be
    # resolved on its own (an unpinned torch is a multi-GB CUDA download).
    command = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check",
               "-c", str(CONSTRAINTS), *args]
    print("+", " ".join(command[1:]), flush=True)
    run_step(command)


def ensure_environment() -> None:
    require_python_3_11()
    # One install at a time: a second command started meanwhile waits here, then finds
    # the environment ready (two first installs at once used to break one of them).
    with open(ROOT / ".venv.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("tasks.py: another install of .venv is running; waiting for it", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        install_locked()


# Torch builds DeepSpeed's CPU op with the first `ninja` on PATH (docs/testing.md, "One build of
# DeepSpeed's op for both of the README's paths"). The environment's own (1.13) and a system one
# (1.11 here) hash a build command differently, so each rebuilds what the other built (30 s to
# minutes). tasks.py and an activated shell put .venv/bin first; a `.venv/bin/torchrun` or
# `.venv/bin/python` started without activating did not, and rebuilt the op with /usr/bin/ninja.
# And without TORCH_EXTENSIONS_DIR such an interpreter built into ~/.cache/torch_extensions, which
# every other environment of the machine shares (checkouts side by side rebuild it for each other,
# and a run waits on another's build lock). This line, run by every interpreter of the environment
# at start (site's .pth files), puts the environment's bin/ first on PATH, as activating does, and
# gives TORCH_EXTENSIONS_DIR the environment's own directory unless it is set: as tasks.py does.
OWN_NINJA_PTH = "shared_params_docs_own_ninja.pth"
OWN_NINJA_LINE = (
    "import os, sys; _bin = os.path.join(sys.prefix, 'bin'); "
    "os.environ['PATH'] = os.environ.get('PATH', '') if os.environ.get('PATH', '').split(os.pathsep)[0] == _bin "
    "else os.pathsep.join(filter(None, [_bin, os.environ.get('PATH')])); "
    "os.environ.setdefault('TORCH_EXTENSIONS_DIR', os.path.join(sys.prefix, 'torch_extensions'))\n")


def ensure_own_ninja_first() -> None:
    """The .pth line above, in the environment's site-packages (written again if missing or another)."""
    for site in (VENV / "lib").glob("python3*/site-packages"):
        pth = site / OWN_NINJA_PTH
        if not pth.exists() or pth.read_text() != OWN_NINJA_LINE:
            pth.write_text(OWN_NINJA_LINE)


def install_locked() -> None:
    ensure_mermaid()
    if VENV.exists() and not CREATED.exists() and not STAMP.exists():
        # Left by an install that was interrupted while it created the environment
        # (e.g. python without pip): it cannot be repaired in place, so start again.
        # (An environment made before CREATED existed has STAMP and is kept.)
        print(f"tasks.py: {VENV} was left half-made by an interrupted install; creating it again", flush=True)
        shutil.rmtree(VENV)
    if not VENV.exists():
        print(f"creating virtual environment {VENV}", flush=True)
        venv.create(VENV, with_pip=False)
        # ensurepip as venv.create(with_pip=True) runs it, but as a child that a Ctrl-C lets
        # finish its cleanup (its wheels go to the command's temporary directory).
        env = {key: value for key, value in os.environ.items() if key not in {"PYTHONHOME", "PYTHONPATH"}}
        run_step([str(PYTHON), "-m", "ensurepip", "--upgrade", "--default-pip"], cwd=VENV,
                 env={**env, "VIRTUAL_ENV": str(VENV)}, stdout=subprocess.DEVNULL)
        CREATED.write_text("venv.create finished\n")
    fingerprint = install_fingerprint()
    if STAMP.exists() and STAMP.read_text() == fingerprint:
        problems = environment_problems()
        if not problems:
            ensure_own_ninja_first()
            return
        print("tasks.py: the environment does not match constraints.txt; repairing it:\n  "
              + "\n  ".join(problems), flush=True)
        STAMP.unlink()
        # pip takes a distribution whose metadata is there for installed, files or not:
        # reinstall those whose files are gone, exactly at their pinned version.
        gone = [problem.split(":")[0] for problem in problems if FILES_GONE in problem]
        if gone:
            pip_install("--force-reinstall", "--no-deps", *gone)
    # 1. torch first, and the build tools DeepSpeed's setup.py needs.
    pip_install("torch", "setuptools")
    # 2. deepspeed is a source archive whose setup.py imports torch: build it
    #    against the torch installed in step 1, not in an isolated environment
    #    (which would resolve a torch of its own).
    pip_install("--no-build-isolation", "deepspeed")
    # 3. Everything else declared in pyproject.toml.
    pip_install("--no-build-isolation", "-e", ".[test,lint,notebook,transformers]")
    problems = environment_problems()
    if problems:
        die("the install finished but the environment still does not match constraints.txt:\n  "
            + "\n  ".join(problems))
    ensure_own_ninja_first()
    STAMP.write_text(fingerprint)
