"""Where the project is, and the few facts about it that the harness, the hooks, the tests and
the version matrix share. Standard library only: `tasks.py` reads it before anything is
installed, and the rank processes import it first.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path


def find_project_root(start: Path) -> Path:
    """The docs project the snippets belong to: the nearest directory at or above `start` that
    holds mkdocs.yml (or `start` itself if none does)."""
    for directory in (start, *start.parents):
        if (directory / "mkdocs.yml").is_file():
            return directory
    return start


# Set RANKRUN_PROJECT to choose the project; by default it is found from the working directory,
# so pytest run from any directory of the project finds the same one.
ROOT = Path(os.environ.get("RANKRUN_PROJECT") or find_project_root(Path.cwd().resolve())).resolve()
SNIPPETS = ROOT / "snippets"
DOCS = ROOT / "docs"
CONSTRAINTS = ROOT / "constraints.txt"

# The command a snippet documents in its docstring, and pages show, e.g.
#   DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/language_model.py
TORCHRUN = re.compile(r"torchrun --nproc_per_node[ =](\d+) (snippets/[\w./-]+\.py)")

# An object's memory address in a message ("<function f at 0x7f63...>"): it changes from run
# to run and from rank to rank, so a rank's cause, an output file and the version matrix's
# data show it as "0x…".
MEMORY_ADDRESS = re.compile(r"(?<= at )0x[0-9a-f]+(?=>)")


def without_addresses(text: str) -> str:
    return MEMORY_ADDRESS.sub("0x…", text)


# The end of a `sitecustomize.py` put first on PYTHONPATH to observe the processes of a run (the
# notebook hook's reads log, coverage in torchrun's ranks): go on to the sitecustomize it shadows.
# Each one chained to is left out of the next search, not only the current one: with two of them
# on PYTHONPATH (torchrun's stacks at abort and its coverage), the second would find the first
# again, without end.
SITECUSTOMIZE_CHAIN = '''
import importlib.machinery, importlib.util, os, sys
_here = os.path.dirname(os.path.abspath(__file__))
if not hasattr(sys, "_rankrun_sitecustomized"):
    sys._rankrun_sitecustomized = set()
sys._rankrun_sitecustomized.add(_here)
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") not in sys._rankrun_sitecustomized])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pins(constraints: Path = CONSTRAINTS) -> dict[str, str]:
    """The `name==version` lines of a constraints file, as {name as written: version}."""
    found = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, _, version = line.partition("==")
            found[name.strip()] = version.strip().split(";", 1)[0].strip()
    return found


# What a rank raises when a peer went away first (its port number varies from run to run): not
# a cause of its own where another rank raised something else.
PEER_WENT_AWAY = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe")
