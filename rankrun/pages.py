"""Where the examples are: snippet files, their output files, their documented commands."""

from __future__ import annotations

import re
from pathlib import Path

from rankrun.project import DOCS, ROOT, SNIPPETS, TORCHRUN


INCLUDE = re.compile(r'--8<--\s+"([^"]+)"')


def includes():
    """(page, file, section or None) for every snippet include in docs/."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for target in INCLUDE.findall(page.read_text()):
            path, _, section = target.partition(":")
            found.append((page.relative_to(ROOT), path, section or None))
    return found


def all_snippets() -> list[Path]:
    """Every example file under snippets/, as paths relative to the repository root."""
    return sorted(path.relative_to(ROOT) for path in SNIPPETS.rglob("*.py"))


def output_file(snippet: Path) -> Path:
    """The file that holds what `snippet` prints; pages include it, tests compare it."""
    return ROOT / Path(snippet).with_suffix(".out")


def documented_world_size(snippet: Path) -> int:
    """The number of ranks in the torchrun command the snippet's docstring gives."""
    text = (ROOT / snippet).read_text()
    commands = [(int(n), path) for n, path in TORCHRUN.findall(text) if path == str(snippet)]
    if not commands:
        raise ValueError(
            f"{snippet} does not document how to run it: its docstring needs a line like "
            f"'DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 {snippet}'"
        )
    return commands[0][0]


def pages_including(path: str | Path) -> list[str]:
    """The pages (docs/...) that include the file at `path` (relative to the project, or
    absolute under it) with --8<--, whole or a section of it."""
    shown = str(Path(path).relative_to(ROOT)) if Path(path).is_absolute() else str(path)
    return sorted({str(page) for page, included, _ in includes() if included == shown})
