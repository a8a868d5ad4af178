"""Markdown for the version notes: every message as one code span, every other character
escaped, upstream references as links; and the examples' own Markdown tables (as they printed
them) read back cell by cell, so that a changed row can be said in a sentence."""

from __future__ import annotations

import re


def code(text: str) -> str:
    """`text` as one inline code span whatever it holds (backticks, `<rank>`, `|`, `*`):
    the fence is one backtick longer than the longest run inside, padded when needed.
    Runs of spaces are shown as one (the browser would collapse them anyway)."""
    text = " ".join(text.split())
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if longest or text.startswith("\\") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def plain(text: str) -> str:
    """`text` as literal text in Markdown: no emphasis, code, link, table cell or HTML tag."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", text)


UPSTREAM_REF = re.compile(r"(?<![\w/])((?:[\w.-]+/[\w.-]+)?)#(\d+)\b")
UPSTREAM_REPO = "deepspeedai/DeepSpeed"


def linked(markdown: str) -> str:
    """Hand-written Markdown with its upstream references (`deepspeedai/DeepSpeed#7018`, and a
    bare `#7104` after one) made links to GitHub; code spans are left alone."""
    parts = re.split(r"(`+[^`]*`+)", markdown)
    repo = UPSTREAM_REPO

    def link(match):
        nonlocal repo
        repo = match.group(1) or repo
        return f"[{match.group(0)}](https://github.com/{repo}/issues/{match.group(2)})"

    return "".join(part if part.startswith("`") else UPSTREAM_REF.sub(link, part) for part in parts)


# --- the examples' tables, read back from what they printed ------------------------------

TABLE_ROW = re.compile(r"^\|.*\|$")
FOOTNOTE = re.compile(r"^- \(([a-z])\) `(.*)`$")


def cells(row: str) -> list[str]:
    """The cells of a Markdown table row, `|` inside code spans kept."""
    found, current, in_code = [], "", False
    for char in row.strip()[1:-1]:
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            found.append(current.strip())
            current = ""
        else:
            current += char
    return found + [current.strip()]


def shortened(line: str, width: int = 72) -> str:
    """A printed line cut at a word to about `width` characters (the line a run did not reach)."""
    line = " ".join(line.split())
    return line if len(line) <= width else line[:width].rsplit(" ", 1)[0] + " ..."


def cell_markdown(cell: str, footnotes: dict[str, str]) -> str:
    """A table cell of an example's output for a sentence: its code spans kept as code, its
    emphasis dropped, a footnote mark `(d)` replaced by the error it stands for."""
    out = []
    for part in re.split(r"(`[^`]+`)", cell):
        if len(part) > 1 and part.startswith("`") and part.endswith("`"):
            out.append(code(part[1:-1]))
            continue
        for piece in re.split(r"(\([a-z]\))", part.replace("**", "").replace("*", "")):
            mark = re.fullmatch(r"\(([a-z])\)", piece)
            if mark and mark.group(1) in footnotes:
                out.append("with " + code(footnotes[mark.group(1)]))
            else:
                out.append(plain(piece))
    return "".join(out).strip()


def table_header(lines: list[str], index: int) -> list[str] | None:
    """The header cells of the table that holds lines[index], if it is a table row."""
    if not TABLE_ROW.match(lines[index]):
        return None
    start = index
    while start > 0 and TABLE_ROW.match(lines[start - 1]):
        start -= 1
    if start + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[start + 1].strip()):
        return cells(lines[start])
    return None


def footnotes_of(lines: list[str]) -> dict[str, str]:
    return {match.group(1): match.group(2) for match in map(FOOTNOTE.match, lines) if match}


def row_change(here: str, there: str, header: list[str], mine: dict, theirs: dict, pinned: str) -> str | None:
    """`row R, column C: V (pinned: W)` for a table row whose cells changed, or None when the
    two lines are not the same row of the same table."""
    a, b = cells(here), cells(there)
    if len(a) != len(b) or len(a) != len(header) or a[0] != b[0]:
        return None
    changed = [i for i in range(len(a)) if a[i] != b[i]]
    label = ", ".join(cell_markdown(cell, theirs) for cell in b[:max(1, changed[0])])
    return f"row {label}: " + "; ".join(
        f"column \u201c{cell_markdown(header[i], theirs)}\u201d: {cell_markdown(a[i], mine)} "
        f"({pinned}: {cell_markdown(b[i], theirs)})" for i in changed)
