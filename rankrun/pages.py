"""Where the examples are and how the pages include them: snippet files, their output files,
their documented commands, and the pages read the way the build reads them (pymdownx.snippets'
own preprocessor resolves every `--8<--`; hooks, tests and the matrix share this one reader)."""

from __future__ import annotations

import re
from pathlib import Path

from rankrun.project import DOCS, ROOT, SNIPPETS, TORCHRUN


def includes():
    """(page, file, section or None) for every snippet include in docs/ (Markdown pages and
    the Markdown cells of the jupytext notebooks)."""
    found, pre = [], snippet_preprocessor()  # one preprocessor for every page
    for page in doc_pages():
        for _, spec in include_specs(page_lines(page), pre):
            path, _, section = spec.partition(":")
            found.append((page.relative_to(ROOT), path, section or None))
    return found


# Examples whose outcome depends on what the process imported first (a model class first
# imported inside deepspeed.zero.Init): they run in fresh rank processes, never the warm pool's,
# which has torch._dynamo imported already.
RUN_FRESH = frozenset({
    "snippets/transformers/import_inside_zero_init.py",
    "snippets/transformers/import_first_zero_init.py",
    "snippets/transformers/hf_config_zero_init.py",
})
# Examples whose documented run is the documented `torchrun` command itself, one rank: every test
# that reads the run reads that one (rankrun.runner.documented_run). first_imports_inside_zero_init
# starts ten new interpreters of its own, and only under torchrun do they inherit its
# TORCHELASTIC_* variables, which its test is about: one run of them, not two.
RUN_BY_TORCHRUN = frozenset({
    "snippets/transformers/first_imports_inside_zero_init.py",
})


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


def snippet_preprocessor():
    """pymdownx.snippets' own preprocessor, configured as mkdocs.yml configures it (the base
    paths made absolute: MkDocs builds from the directory of mkdocs.yml)."""
    import markdown

    _, settings = markdown_settings()
    md = markdown.Markdown(extensions=["pymdownx.snippets"],
                           extension_configs={"pymdownx.snippets": settings["pymdownx.snippets"]})
    preprocessor = md.preprocessors["snippet"]
    preprocessor.seen, preprocessor.bases, preprocessor.failed = set(), None, set()
    return preprocessor


def include_specs(lines: list[str], preprocessor=None) -> list[tuple[int, str]]:
    """(line index, target as written: `path` or `path:section`) of every include on a page,
    in the inline form (`--8<-- "path"`) and the block form (paths between two `--8<--`
    lines), recognised by pymdownx.snippets' own patterns; escaped notation is skipped."""
    pre = preprocessor or snippet_preprocessor()
    found, block = [], False
    for index, line in enumerate(lines):
        match = pre.RE_ALL_SNIPPETS.match(line)
        if match and match.group("escape"):
            continue
        if match and not match.group("inline_marker"):
            block = not block
            continue
        if match:
            spec = match.group("snippet")[1:-1].strip()
        elif block:
            spec = line.strip()
        else:
            continue
        if spec and not spec.startswith(";"):
            found.append((index, spec))
    return found


def snippet_notation(lines: list[str], preprocessor=None) -> list[bool]:
    """For each line: is it snippet notation (an include line, a block marker, a path in a block)?"""
    return (preprocessor or snippet_preprocessor()).get_syntax_mask(lines)


def unescaped(lines: list[str]) -> list[str]:
    """The lines as the page shows them: pymdownx.snippets removes the `;` that escapes snippet
    notation (`;--8<-- "…"`, `# ;--8<-- [start:name]`)."""
    pre = snippet_preprocessor()
    shown = []
    for line in lines:
        match = pre.RE_ALL_SNIPPETS.match(line)
        section = pre.match_section(line)
        if match and match.group("escape"):
            line = line.replace(";", "", 1)
        elif section and section.group("escape"):
            line = (section.group("pre") + section.group("escape").replace(";", "", 1)
                    + section.group("inline_marker") + section.group("section") + section.group("post"))
        shown.append(line)
    return shown


def included_files(lines: list[str], preprocessor=None) -> list[tuple[str, Path, str]]:
    """(target as written, resolved file, included text) for every include on a page."""
    pre = preprocessor or snippet_preprocessor()
    found = []
    for _, spec in include_specs(lines, pre):
        target = pre.parse_snippet_target(spec)
        path = pre.get_snippet_path(target["path"]) if target else None
        if path is None:
            continue  # tests/test_inventory.py and the strict build report a missing file
        selected = pre.select_snippet_lines(pre.read_lines(path), target)
        expanded_lines = pre.parse_snippets(selected, path, is_section=target["section"] is not None)
        found.append((spec, Path(path), "\n".join(expanded_lines)))
    return found


def page_outputs(lines: list[str]) -> list[tuple[str, str]]:
    """(target, text) of every output file a page includes: every included file that is not a .py example."""
    return [(spec, text) for spec, path, text in included_files(lines) if path.suffix != ".py"]


def page_code(lines: list[str]) -> list[tuple[str, str]]:
    """(target, text) of every example (.py) a page includes: what its code spans may quote."""
    return [(spec, text) for spec, path, text in included_files(lines) if path.suffix == ".py"]


def doc_pages() -> list[Path]:
    """Every page source: docs/**/*.md and the jupytext notebooks docs/**/*.py (not assets)."""
    found = sorted(DOCS.rglob("*.md")) + sorted(DOCS.rglob("*.py"))
    return [page for page in found if "assets" not in page.relative_to(DOCS).parts]


def page_name(page: Path) -> str:
    """A page's path relative to docs/."""
    return str(page.relative_to(DOCS))


def page_lines(page: Path) -> list[str]:
    """The page's Markdown lines; for a jupytext notebook, its Markdown cells (other lines blanked)."""
    lines = page.read_text().split("\n")
    if page.suffix != ".py":
        return lines
    markdown_lines, in_markdown = [], False
    for line in lines:
        if line.startswith("# %%"):
            in_markdown = "[markdown]" in line
            markdown_lines.append("")
        elif in_markdown and (line == "#" or line.startswith("# ")):
            markdown_lines.append(line[2:])
        else:
            markdown_lines.append("")
    return markdown_lines


def normalise(text: str) -> str:
    """Every run of whitespace as one space."""
    return " ".join(text.split())


# A line that opens or closes a fenced block (its fence and the rest of the line).
FENCE_LINE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")
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


# Where only rank 0 of a run prints, an output block's label says so right before its link
# (tests/test_snippets.py checks it against the run).
ONLY_RANK_0 = "; only rank 0 prints"


def fenced_blocks(lines: list[str], preprocessor=None):
    """(index of the opening fence, index of the closing fence) of each fenced block of a page,
    the fences of the --8<-- notation's own examples (escaped includes) left out."""
    notation = snippet_notation(lines, preprocessor)
    index = 0
    while index < len(lines):
        fence = FENCE_LINE.match(lines[index])
        if not fence or notation[index]:
            index += 1
            continue
        marker = fence.group(1)
        closing = re.compile(rf"^\s*{re.escape(marker[0])}{{{len(marker)},}}\s*$")
        end = index + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        yield index, end
        index = end + 1


def output_blocks(lines: list[str]) -> list[tuple[int, str, list[tuple[str, Path]]]]:
    """(line of the fence, the paragraph before it, the output files it includes as (target as
    written, resolved file)) for each fenced block that includes output files."""
    blocks, pre = [], snippet_preprocessor()  # one preprocessor for the page's blocks
    for index, end in fenced_blocks(lines, pre):
        # runner transcripts; other data files say what they are
        outputs = [(spec, path) for spec, path, _ in included_files(lines[index + 1:end], pre)
                   if path.suffix == ".out"]
        if outputs:
            before = index - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            paragraph = []
            while before >= 0 and lines[before].strip() and not FENCE_LINE.match(lines[before]):
                paragraph.insert(0, lines[before].strip())
                before -= 1
            blocks.append((index + 1, " ".join(paragraph), outputs))
    return blocks


def included_in_code_blocks(lines: list[str]) -> list[tuple[str, str]]:
    """(target as written, included text) of every include inside a fenced code block, which
    renders as code (an include outside one, such as a generated note, renders as Markdown)."""
    pre = snippet_preprocessor()  # one preprocessor for the page's blocks
    return [(spec, text) for index, end in fenced_blocks(lines, pre)
            for spec, _, text in included_files(lines[index + 1:end], pre) if text.strip()]
