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


def runs_before(snippet: Path) -> list[tuple[str, int]]:
    """The other examples the snippet's docstring says to run first, with their rank counts:
    the torchrun commands it documents for other files, before its own."""
    commands = TORCHRUN.findall((ROOT / snippet).read_text())
    own = [i for i, (_, path) in enumerate(commands) if path == str(snippet)]
    return [(path, int(n)) for n, path in commands[:own[0]] if path != str(snippet)] if own else []


def pages_including(path: str | Path) -> list[str]:
    """The pages (docs/...) that include the file at `path` (relative to the project, or
    absolute under it) with --8<--, whole or a section of it."""
    shown = str(Path(path).relative_to(ROOT)) if Path(path).is_absolute() else str(path)
    return sorted({str(page) for page, included, _ in includes() if included == shown})


# --- the pages as the build reads them ------------------------------------------------------

def markdown_settings() -> tuple[list[str], dict[str, dict]]:
    """mkdocs.yml's `markdown_extensions` as MkDocs loads them: (names, settings per name),
    MkDocs' own defaults (toc, tables, fenced_code) first; the snippet base path made absolute."""
    from mkdocs.utils.yaml import yaml_load

    config = yaml_load((ROOT / "mkdocs.yml").read_text())
    names, settings = ["toc", "tables", "fenced_code"], {}
    for item in config.get("markdown_extensions", []):
        name, options = next(iter(item.items())) if isinstance(item, dict) else (item, None)
        if name not in names:
            names.append(name)
        settings[name] = dict(options or {})
    snippets = settings.setdefault("pymdownx.snippets", {})
    snippets["base_path"] = [str(ROOT / path) for path in snippets.get("base_path", ["."])]
    return names, settings


def markdown_converter():
    """A Markdown converter with the build's extensions and settings."""
    import markdown

    names, settings = markdown_settings()
    return markdown.Markdown(extensions=names, extension_configs=settings)


def expanded(text: str) -> str:
    """A page's Markdown with every `--8<--` include replaced by what it includes, by
    pymdownx.snippets itself with the build's settings (sections, dedenting, markers)."""
    converter = markdown_converter()
    return "\n".join(converter.preprocessors["snippet"].run(text.split("\n")))


def rendered(text: str) -> str:
    """A page's Markdown as HTML, with the build's extensions (without MkDocs' hooks and theme)."""
    return markdown_converter().convert(text)


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
                   re.MULTILINE | re.DOTALL)


def code_blocks(markdown_text: str, language: str = "python") -> list[tuple[int, str, str]]:
    """(line number, title, code) of every fenced block in `language`, the code dedented."""
    import textwrap

    found = []
    for match in FENCE.finditer(markdown_text):
        info = match.group("info").strip()
        if info.split(" ", 1)[0] not in (language, f"{{.{language}"):
            continue
        title = re.search(r'title="([^"]*)"', info)
        body = "".join(line[len(match.group("indent")):] if line.startswith(match.group("indent")) else line
                       for line in match.group("body").splitlines(keepends=True))
        found.append((markdown_text.count("\n", 0, match.start()) + 1, title.group(1) if title else "",
                      textwrap.dedent(body)))
    return found
