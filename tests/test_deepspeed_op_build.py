"""One build of DeepSpeed's CPU op serves both of the README's paths: `python3 tasks.py test`
and `source .venv/bin/activate; DS_ACCELERATOR=cpu torchrun ...` (with TORCH_EXTENSIONS_DIR set
to the same directory, as the README says), and both passes of `.ci/run` (the second under
ATEN_CPU_CAPABILITY=default). A reader or CI that alternates between them must not pay a rebuild
each time: the build's .ninja_log gets no new entry and the .so stays as it was."""

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


def through_tasks_py(**variables: str) -> None:
    """The environment `python3 tasks.py test` gives pytest and its ranks (devtasks.child_env)."""
    shell = {**a_readers_shell(), **variables}
    script = "import json; from devtasks.child_env import environment; print(json.dumps(environment()))"
    given = subprocess.run([sys.executable, "-c", script],
                           cwd=ROOT, env=shell, capture_output=True, text=True, check=True)
    env = json.loads(given.stdout)
    subprocess.run([str(VENV / "bin" / "python"), "-c", LOAD], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=900)


def through_the_activated_venv(**variables: str) -> None:
    """The README's second path: the venv activated in bash, TORCH_EXTENSIONS_DIR as it says."""
    script = (f"source .venv/bin/activate && TORCH_EXTENSIONS_DIR=.venv/torch_extensions DS_ACCELERATOR=cpu "
              f"python -c '{LOAD}'")
    subprocess.run(["bash", "-c", script], cwd=ROOT, env={**a_readers_shell(), **variables}, check=True,
                   capture_output=True, timeout=900)


def through_the_venv_not_activated(**variables: str) -> None:
    """`.venv/bin/python` (or `.venv/bin/torchrun`, or `.venv/bin/python -m pytest`) started without
    activating the environment and without TORCH_EXTENSIONS_DIR: the system's ninja came first on the
    shell's PATH, which rebuilt the op, and torch built into ~/.cache/torch_extensions, which every
    environment of the machine shares (devtasks.install, OWN_NINJA_PTH)."""
    env = {**a_readers_shell(), "DS_ACCELERATOR": "cpu", **variables}
    subprocess.run([str(VENV / "bin" / "python"), "-c", LOAD], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=900)


# .ci/run's second pass runs the example tests under PyTorch's portable kernels.
SECOND_PASS = {"ATEN_CPU_CAPABILITY": "default"}


def the_build() -> tuple[str, int]:
    return (BUILD / ".ninja_log").read_text(), (BUILD / "deepspeed_shm_comm.so").stat().st_mtime_ns


@pytest.mark.slow
def test_alternating_the_paths_and_the_passes_builds_the_op_once():
    if not (BUILD / "deepspeed_shm_comm.so").exists():
        through_tasks_py()  # built by tasks.py before pytest starts; a plain pytest may come first
    built = the_build()
    # .ci/run's second pass right after its first (the build above, or tasks.py's), the README's
    # torchrun after CI, a .venv interpreter started without activating, then the first pass again:
    # each path right after another one (each load imports DeepSpeed in a new interpreter: 5 s of CPU)
    steps = [("the second pass (tasks.py, ATEN_CPU_CAPABILITY=default)", through_tasks_py, SECOND_PASS),
             ("the README's activated torchrun", through_the_activated_venv, {}),
             (".venv/bin/python without activating", through_the_venv_not_activated, {}),
             ("the first pass (tasks.py)", through_tasks_py, {})]
    for name, path, variables in steps:
        path(**variables)
        assert the_build() == built, (
            f"{name} rebuilt DeepSpeed's op ({BUILD / '.ninja_log'} got a new entry):\n"
            f"before:\n{built[0]}\nafter:\n{the_build()[0]}")
