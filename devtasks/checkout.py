"""Where things are in this checkout, and how a command stops on a mistake.

Every module of the package needs the checkout's root, its `.venv` and `constraints.txt`; a
scratch copy of the project (the tests of the install) has its own, found from this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
CONSTRAINTS = ROOT / "constraints.txt"


def die(message: str) -> None:
    print(f"tasks.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def require_python_3_11() -> None:
    if sys.version_info[:2] != (3, 11):
        die(f"needs Python 3.11 (the pinned torch 2.13.0 wheel is cp311); this is {sys.version.split()[0]}")
