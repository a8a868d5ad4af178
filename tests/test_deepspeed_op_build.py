"""One build of DeepSpeed's CPU op serves both of the README's paths: `python3 tasks.py test`
and `source .venv/bin/activate; DS_ACCELERATOR=cpu torchrun ...` (with TORCH_EXTENSIONS_DIR set
to the same directory, as the README says). A reader who alternates between them must not pay
a rebuild each time: the build's .ninja_log and the .so stay as they were."""

import json
import os
import subprocess
import sys

import pytest

from rankrun.runner import ROOT

VENV = ROOT / ".venv"
BUILD = VENV / "torch_extensions" / "deepspeed_shm_comm"
# What DeepSpeed does on its first CPU init (deepspeed.comm.torch), and tasks.py before pytest.
LOAD = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


def a_readers_shell() -> dict[str, str]:
    """This environment as a reader's shell has it before either path: no venv activated, no
    TORCH_EXTENSIONS_DIR, nothing the test session set."""
    env = {key: value for key, value in os.environ.items()
           if key not in {"VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR", "TMPDIR"} and not key.startswith("RANKRUN_")}
    env["PATH"] = os.pathsep.join(part for part in env.get("PATH", "").split(os.pathsep)
                                  if part and os.path.realpath(part) != os.path.realpath(VENV / "bin"))
    return env


def through_tasks_py() -> None:
    """The environment `python3 tasks.py test` gives pytest and its ranks (devtasks.child_env)."""
    shell = a_readers_shell()
    script = "import json; from devtasks.child_env import environment; print(json.dumps(environment()))"
    given = subprocess.run([sys.executable, "-c", script],
                           cwd=ROOT, env=shell, capture_output=True, text=True, check=True)
    env = json.loads(given.stdout)
    subprocess.run([str(VENV / "bin" / "python"), "-c", LOAD], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=900)


def through_the_activated_venv() -> None:
    """The README's second path: the venv activated in bash, TORCH_EXTENSIONS_DIR as it says."""
    script = (f"source .venv/bin/activate && TORCH_EXTENSIONS_DIR=.venv/torch_extensions DS_ACCELERATOR=cpu "
              f"python -c '{LOAD}'")
    subprocess.run(["bash", "-c", script], cwd=ROOT, env=a_readers_shell(), check=True, capture_output=True,
                   timeout=900)


def the_build() -> tuple[str, int]:
    return (BUILD / ".ninja_log").read_text(), (BUILD / "deepspeed_shm_comm.so").stat().st_mtime_ns


@pytest.mark.slow
def test_alternating_the_two_paths_builds_the_op_once():
    if not (BUILD / "deepspeed_shm_comm.so").exists():
        through_tasks_py()  # built by tasks.py before pytest starts; a plain pytest may come first
    built = the_build()
    for path in (through_the_activated_venv, through_tasks_py):  # each way once after the other
        path()
        assert the_build() == built, (
            f"{path.__name__} rebuilt DeepSpeed's op ({BUILD / '.ninja_log'} changed):\n"
            f"before:\n{built[0]}\nafter:\n{the_build()[0]}")
