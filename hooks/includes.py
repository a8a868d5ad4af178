"""Check a page's snippet includes before Markdown runs, and stop the build with one clear line.

Without this, a renamed `# --8<-- [start:model]` marker or a missing output file surfaces as
pymdownx.snippets' error buried in hundreds of lines of repeated tracebacks. Here the build
stops at the first broken include with: the page, the include as written, and what is missing.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.exceptions import PluginError

from rankrun.pages import include_specs  # the includes as pymdownx.snippets reads them


def broken_include(target: str, root: Path) -> str | None:
    """What is wrong with one include target, or None."""
    path, _, section = target.partition(":")
    file = root / path
    if not file.is_file():
        return f"the file {path} does not exist"
    if section and not section[0].isdigit():  # `path:12:30` is a line range, not a section
        text = file.read_text()
        missing = [marker for marker in (f"[start:{section}]", f"[end:{section}]") if marker not in text]
        if missing:
            return (f"{path} has no section {section!r} (missing {' and '.join(missing)}); "
                    f"rename the include or the markers in {path}")
    return None


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not page.file.src_uri.endswith(".md"):
        return markdown
    root = Path(config.config_file_path).parent
    for index, target in include_specs(markdown.splitlines()):
        problem = broken_include(target, root)
        if problem:
            raise PluginError(f'docs/{page.file.src_uri}:{index + 1}: --8<-- "{target}": {problem}')
    return markdown
