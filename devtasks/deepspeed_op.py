"""Compiling DeepSpeed's CPU communication op once, before `tasks.py test` starts pytest.

DeepSpeed compiles it on its first init: about a minute, several on a loaded machine. Left to the
tests, the first runs wait for it (torch's file lock) and time out (seen in CI while the version
matrix ran beside it); here it runs once, with no timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

from devtasks import supervision
from devtasks.checkout import die
from devtasks.child_env import environment, run_in_venv


def build_deepspeed_op() -> None:
    """Compile DeepSpeed's CPU communication op for this environment now, if it is not yet."""
    directory = Path(environment()["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    if (directory / "deepspeed_shm_comm.so").exists():
        return
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > 15 * 60:
        lock.unlink()  # left by a build that was killed: torch would wait for it forever
    print("tasks.py: compiling DeepSpeed's CPU communication op for this environment (once; a minute "
          "or more)", flush=True)
    if run_in_venv("-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()") != 0:
        if supervision.interrupted:
            raise KeyboardInterrupt
        die("compiling DeepSpeed's CPU communication op failed (its output is above)")
