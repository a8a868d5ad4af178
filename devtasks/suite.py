"""The `test` command: pytest on every core, after DeepSpeed's op is compiled.

`--quick` is this command's own option (the examples and pages only); the rest are pytest's.
"""

from __future__ import annotations

import os

from devtasks.child_env import run_in_venv
from devtasks.deepspeed_op import build_deepspeed_op


def run_tests(rest: list[str]) -> int:
    """pytest with `rest` (its options and --quick), until it ends."""
    build_deepspeed_op()
    return run_in_venv("-m", "pytest", *pytest_arguments(rest))


def pytest_arguments(rest: list[str]) -> list[str]:
    """`rest` with --quick turned into a marker expression, and a worker per core unless -n was given."""
    arguments = []
    for arg in rest:
        if arg == "--quick":
            arguments += ["-m", "not slow"]
        else:
            arguments.append(arg)
    chose_workers = any(arg in {"-n", "--numprocesses"} or arg.startswith(("-n", "--numprocesses="))
                        for arg in arguments)
    # `-p no:xdist` turns pytest-xdist off: then there is no -n to pass.
    xdist_off = any(a in {"no:xdist", "-pno:xdist"} for a in arguments)
    if not chose_workers and not xdist_off:
        # One worker per core of this machine; a file's tests stay on one worker, so its
        # module fixtures are set up once (the workers share one site build: tests/test_site.py).
        arguments = ["-n", str(os.cpu_count() or 1), "--dist", "loadfile", *arguments]
    return arguments
