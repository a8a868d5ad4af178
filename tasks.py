#!/usr/bin/env python3
"""The project's two commands, plus the install they share.

    python3 tasks.py serve [mkdocs serve options]   build and serve the site locally
    python3 tasks.py test  [pytest options]         run the whole test suite
    python3 tasks.py test --quick [pytest options]  only the examples and pages (no `slow` tests)
    python3 tasks.py notebook [jupyter lab options] open the walkthrough notebook in JupyterLab
    python3 tasks.py matrix [--check] [--help]      the DeepSpeed version matrix (versions/matrix.py)

`test` runs pytest on every core (pytest-xdist: -n os.cpu_count(), a test file's tests
on one worker); pass -n 0 to run in one process. `serve` reuses the notebook's last
executed output while nothing it depends on changed (hooks/notebooks.py).

Both create (or reuse) the virtual environment `.venv/` and install exactly the
versions in `constraints.txt`. Standard library only: this file runs before
anything is installed.
"""

from __future__ import annotations

import subprocess
import sys

from devtasks import supervision
from devtasks.checkout import die, require_python_3_11
from devtasks.install import ensure_environment
from devtasks.notebook import notebook
from devtasks.serve import serve, serve_address
from devtasks.suite import run_tests

COMMANDS = ("serve", "test", "notebook", "matrix", "install")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] in {"-h", "--help", "help"}:
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        die(f"unknown command {command!r}; the commands are {', '.join(COMMANDS[:-1])} "
            f"(python3 tasks.py --help says what each does)")
    supervision.become_subreaper()
    with supervision.command_temporary_directory():
        return run_command(command, rest)


def run_command(command: str, rest: list[str]) -> int:
    if command == "matrix":
        return matrix(rest)
    if command == "serve":
        # Before the install check: a bad or taken address is said at once, not after minutes of work.
        address = serve_address(rest)
    ensure_environment()
    if command == "install":
        return 0
    if command == "serve":
        return serve(rest, address)
    if command == "notebook":
        return notebook(rest)
    return run_tests(rest)


def matrix(rest: list[str]) -> int:
    # The DeepSpeed version matrix builds its own environments (one per release); it does
    # not need .venv/. Standard library only, like this file.
    require_python_3_11()
    from versions import matrix as version_matrix
    return version_matrix.main(rest)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as error:
        die(f"install step failed with exit code {error.returncode}: {' '.join(map(str, error.cmd))}")
    except KeyboardInterrupt:
        print("tasks.py: interrupted", file=sys.stderr)
        sys.exit(130)
