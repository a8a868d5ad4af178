"""The environment the commands' children run in, and running `.venv`'s python in it.

pytest, mkdocs, JupyterLab and the DeepSpeed op build all get it; the benchmarks import
`environment()` to run what they time exactly as `tasks.py` runs it.
"""

from __future__ import annotations

import os
from pathlib import Path

from devtasks.checkout import PYTHON, ROOT, VENV
from devtasks.supervision import run_child


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("NO_MKDOCS_2_WARNING", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(own_extensions_dir()))
    # The environment's bin/ first on PATH, as `source .venv/bin/activate` puts it for the README's
    # torchrun: torch builds DeepSpeed's op with the first `ninja` on PATH. The venv's ninja (1.13,
    # rapidhash, .ninja_log v7) and a system one (1.11 here, MurmurHash2, v5) hash a command
    # differently, so each finds the other's log stale and rebuilds the op in place (30 s or
    # more) every time a reader switches between `tasks.py test` and the activated torchrun.
    bin_dir = str(VENV / "bin")
    if env.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        env["PATH"] = os.pathsep.join([bin_dir, *filter(None, [env.get("PATH")])])
    return env


def own_extensions_dir() -> Path:
    # DeepSpeed compiles its CPU communication op on first use into TORCH_EXTENSIONS_DIR
    # (default ~/.cache/torch_extensions). Environments with different DeepSpeed releases
    # sharing that directory rebuild it back and forth and crash each other
    # (AttributeError: module 'deepspeed_shm_comm' has no attribute 'vector_kernel_level'),
    # so this environment keeps its own, as every environment of the version matrix does.
    return VENV / "torch_extensions"


def run_in_venv(*args: str) -> int:
    return run_child([str(PYTHON), *args], cwd=ROOT, env=environment())
