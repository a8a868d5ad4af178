"""Drift gate: every number, shape or message a page types must come from a run, or be reviewed.

The rule (docs/testing.md, "Numbers and messages on the pages come from runs", says the same):

Pages
    Every `docs/**/*.md`, and the Markdown cells (`# %% [markdown]`) of the jupytext notebooks
    `docs/**/*.py`.

What is not checked
    Included text: it is an output file or a tested example. Lines of snippet notation
    (`--8<-- "…"`, and block markers with the paths between them) are dropped, and a fenced
    block that holds nothing but snippet notation is skipped. Link targets and URLs.

Literals (what is checked)
    1. An inline code span (in prose, headings, tables, admonitions) that holds a number or an
       exception name; the literal is the span's text.
    2. A line of a typed fenced block (any language: text, python, bash, mermaid) that holds a
       number or an exception name; the literal is the line, stripped.
    3. A number in prose (outside code spans): any decimal (`3.8160`, and versions `0.19.8`)
       and any integer >= 10. Issue references (`#1047`) are names, not numbers, and ordered
       list markers (`10.`) are not numbers.
    A *number* is a run of digits not preceded by a letter, digit or underscore: `ZeRO-3`,
    `(16, 8)`, `1e-6`, `[0]` hold numbers; digits inside a name (`layer1`, `fp32`, `mat2`,
    `stage3_max_reuse_distance`) do not. An *exception name* is a word ending in `Error`,
    `Exception` or `Warning`. A torchrun command `torchrun --nproc_per_node N snippets/….py`
    is not a number: tests/test_inventory.py checks N against the snippet's own command.

When a literal passes
    a. It occurs in an output file the same page includes with `--8<--`: every included file
       that is not a `.py` example (the `.out` files, and any generated data file). Includes
       are resolved by pymdownx.snippets itself, configured from mkdocs.yml (`base_path`,
       sections, line ranges, nested includes), so the test sees what the build shows.
    b. Or, for a code span only, it quotes code from an example (`.py`) the same page includes,
       the way the page shows it (`modifier_rank=0`, `self.tied[0]`): the suite runs that code.
    c. Or the allow-list `tests/prose_literals_allowlist.tsv` has it for this page (or `*`):
       `page<TAB>literal<TAB>reason`, page relative to docs/. A reason is required, and an
       entry that no failing literal needs is stale and fails the test.

Normalisation
    Every run of whitespace (a line break inside a code span, the indentation of an output
    file) counts as one space, in the literal and in the output. A literal must not start or
    end in the middle of a word or number of the output: `1.0` does not match `1.0913`.
    `…` in a literal stands for left-out text: the pieces around it must occur in that order
    within one line of an output file. A prose number must occur as a whole number. Escaped
    notation (`;--8<--`) is checked as the page shows it, without the `;`.

Also: no line of prose may hold an unescaped section marker (`--8<-- [start:name]`), which
pymdownx.snippets would remove from the page without a word.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from rankrun.pages import FENCE_LINE as FENCE
from rankrun.pages import doc_pages as pages
from rankrun.pages import (normalise, page_code, page_lines, page_name, page_outputs,
                           snippet_notation, snippet_preprocessor, unescaped)
from rankrun.project import ROOT, TORCHRUN

# A whole torchrun command (the regex in rankrun.project captures its rank count and path).
TORCHRUN_COMMAND = re.compile(TORCHRUN.pattern.replace("(", "(?:"))

ALLOWLIST = ROOT / "tests" / "prose_literals_allowlist.tsv"
ALLOWLIST_NAME = "tests/prose_literals_allowlist.tsv"

NUMBER = re.compile(r"(?<![\w])\d")
EXCEPTION = re.compile(r"\b\w+(?:Error|Exception|Warning)\b")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
# Link targets `](…)`, autolinks `<http…>`, bare URLs, HTML comments: not prose.
NOT_PROSE = re.compile(r"\]\([^)]*\)|<https?://[^>]*>|https?://\S+|<!--.*?-->", re.DOTALL)
LIST_MARKER = re.compile(r"^(\s*)\d+\.(?=\s)", re.MULTILINE)
PROSE_NUMBER = re.compile(r"(?<![\w.#])\d+(?:\.\d+)*")


@dataclass(frozen=True)
class Literal:
    page: str  # relative to docs/
    line: int
    kind: str  # "code span", "typed block line", "prose number"
    text: str  # normalised

    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def holds_a_number_or_exception(text: str) -> bool:
    text = TORCHRUN_COMMAND.sub(" ", text)
    return bool(NUMBER.search(text) or EXCEPTION.search(text))


# ---------------------------------------------------------------- pages and their literals


def literals(page_name: str, lines: list[str]) -> list[Literal]:
    notation = snippet_notation(lines)
    lines = unescaped(lines)
    found: list[Literal] = []
    paragraph: list[tuple[int, str]] = []

    def flush():
        if paragraph:
            found.extend(prose_literals(page_name, paragraph))
            paragraph.clear()

    index = 0
    while index < len(lines):
        line = lines[index]
        fence = FENCE.match(line)
        if fence and not notation[index]:
            flush()
            marker = fence.group(1)
            closing = re.compile(rf"^\s*{re.escape(marker[0])}{{{len(marker)},}}\s*$")
            end = index + 1
            while end < len(lines) and not closing.match(lines[end]):
                end += 1
            body = range(index + 1, min(end, len(lines)))
            typed = [n for n in body if lines[n].strip() and not notation[n]]
            for n in typed:
                if holds_a_number_or_exception(lines[n]):
                    found.append(Literal(page_name, n + 1, "typed block line", normalise(lines[n])))
            index = end + 1
            continue
        if not line.strip() or notation[index]:
            flush()
        else:
            paragraph.append((index + 1, line))
        index += 1
    flush()
    return found


def prose_literals(page_name: str, paragraph: list[tuple[int, str]]) -> list[Literal]:
    text = "\n".join(line for _, line in paragraph)
    starts = []  # offset of each line's start in `text`
    offset = 0
    for _, line in paragraph:
        starts.append(offset)
        offset += len(line) + 1

    def line_at(position: int) -> int:
        return paragraph[max(i for i, start in enumerate(starts) if start <= position)][0]

    found = []
    blank = list(text)

    def blank_out(start: int, end: int):
        for i in range(start, end):
            if blank[i] != "\n":
                blank[i] = " "

    for match in NOT_PROSE.finditer(text):
        blank_out(match.start(), match.end())
    stripped = "".join(blank)
    for match in CODE_SPAN.finditer(stripped):
        content = normalise(text[match.start(2):match.end(2)])
        if holds_a_number_or_exception(content):
            found.append(Literal(page_name, line_at(match.start()), "code span", content))
        blank_out(match.start(), match.end())
    prose = LIST_MARKER.sub(lambda m: m.group(1), "".join(blank))
    for match in PROSE_NUMBER.finditer(prose):
        number = match.group()
        if "." in number or int(number) >= 10:
            found.append(Literal(page_name, line_at(match.start()), "prose number", number))
    return found


def occurs(literal: Literal, outputs: list[tuple[str, str]]) -> bool:
    if literal.kind == "prose number":
        pattern = re.compile(rf"(?<![\d.]){re.escape(literal.text)}(?!\.?\d)")
        return any(pattern.search(text) for _, text in outputs)
    pieces = [piece.strip() for piece in literal.text.split("…")]
    pattern = r".*?".join(re.escape(piece) for piece in pieces if piece)
    if pieces[0] and pieces[0][0].isalnum():
        pattern = r"(?<!\w)" + pattern
    if pieces[-1] and pieces[-1][-1].isalnum():
        pattern += r"(?!\w|\.\d)"
    pattern = re.compile(pattern)
    if len(pieces) > 1:
        return any(pattern.search(normalise(line)) for _, text in outputs for line in text.split("\n"))
    return any(pattern.search(normalise(text)) for _, text in outputs)


# ---------------------------------------------------------------- the allow-list


@dataclass(frozen=True)
class Allowed:
    line: int
    page: str
    literal: str
    reason: str


def read_allowlist(path: Path = ALLOWLIST) -> tuple[list[Allowed], list[str]]:
    """The entries, and what is wrong with the file (malformed lines, empty reasons)."""
    entries, problems = [], []
    if not path.exists():
        return entries, problems
    for number, line in enumerate(path.read_text().split("\n"), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            problems.append(f"{ALLOWLIST_NAME}:{number}: needs page<TAB>literal<TAB>reason, got {len(fields)} field(s)")
            continue
        page, literal, reason = (field.strip() for field in fields)
        if not page or not literal:
            problems.append(f"{ALLOWLIST_NAME}:{number}: empty page or literal")
        elif not reason:
            problems.append(f"{ALLOWLIST_NAME}:{number}: {literal!r} has no reason; say why it need not come from a run")
        else:
            entries.append(Allowed(number, page, normalise(literal), reason))
    return entries, problems


def allowed_by(literal: Literal, entries: list[Allowed]) -> list[Allowed]:
    return [entry for entry in entries if entry.page in (literal.page, "*") and entry.literal == literal.text]


# ---------------------------------------------------------------- the check


def check_page(page_name: str, lines: list[str], entries: list[Allowed]) -> tuple[list[str], set[Allowed]]:
    """The failures on one page, and the allow-list entries it needed."""
    outputs, code = page_outputs(lines), page_code(lines)
    failures, used = [], set()
    for literal in literals(page_name, lines):
        if occurs(literal, outputs):
            continue
        if literal.kind == "code span" and occurs(literal, code):
            continue
        allowing = allowed_by(literal, entries)
        if allowing:
            used.update(allowing)
            continue
        failures.append(explain(literal, outputs))
    return failures, used


def explain(literal: Literal, outputs: list[tuple[str, str]]) -> str:
    included = ", ".join(spec for spec, _ in outputs) or "none"
    quoting = ", quotes no example the page includes," if literal.kind == "code span" else ""
    return (
        f"{literal.where()}: {literal.kind} `{literal.text}` is in no output file this page includes "
        f"(included: {included}){quoting} and not in {ALLOWLIST_NAME}.\n"
        f"    Fix: show what the run printed: include the output that prints it, or make the snippet "
        f"print it and regenerate with --update-outputs, and copy it verbatim. Only if it is not an "
        f"output (a config key, an API argument, a version, a command), add the line "
        f"'{literal.page}<TAB>{literal.text}<TAB><reason>' to {ALLOWLIST_NAME}."
    )


@pytest.mark.parametrize("page", pages(), ids=page_name)
def test_every_literal_on_the_page_comes_from_a_run_or_is_allowed(page):
    entries, _ = read_allowlist()
    failures, _ = check_page(page_name(page), page_lines(page), entries)
    assert not failures, "\n" + "\n".join(failures)


def test_allowlist_is_well_formed():
    _, problems = read_allowlist()
    assert not problems, "\n".join(problems)


def test_allowlist_has_no_stale_entries():
    entries, _ = read_allowlist()
    used: set[Allowed] = set()
    for page in pages():
        used |= check_page(page_name(page), page_lines(page), entries)[1]
    stale = [entry for entry in entries if entry not in used]
    assert not stale, "\n".join(
        f"{ALLOWLIST_NAME}:{entry.line}: {entry.page}\t{entry.literal} is stale: no literal on "
        f"{'any page' if entry.page == '*' else 'docs/' + entry.page} needs it (it changed, or an output now shows it); "
        f"remove the line" for entry in stale
    )


def removed_lines(lines: list[str]) -> list[int]:
    """Line numbers of page lines that pymdownx.snippets drops without a word: a line of prose
    that holds an unescaped section marker (`--8<-- [start:name]`)."""
    pre = snippet_preprocessor()
    removed, block = [], False
    for number, line in enumerate(lines, start=1):
        match = pre.RE_ALL_SNIPPETS.match(line)
        if match:
            block = block != (not match.group("inline_marker") and not match.group("escape"))
            continue
        section = pre.match_section(line)
        if not block and section and not section.group("escape"):
            removed.append(number)
    return removed


@pytest.mark.parametrize("page", pages(), ids=page_name)
def test_no_line_of_the_page_is_silently_removed(page):
    removed = removed_lines(page_lines(page))
    assert not removed, "\n".join(
        f"docs/{page_name(page)}:{number}: pymdownx.snippets removes this line from the page (it holds a "
        f"section marker); write the marker as `# ;--8<-- [start:name]`, one per line" for number in removed
    )


# ---------------------------------------------------------------- the gate bites


SYNTHETIC_PAGE = """\
# A page

The copies start `3.8160` apart, and the loss is 2.8627 at
step 0; the message is `RuntimeError: mat2 must be a
matrix` and its shape `(0,)`.

```text
--8<-- "snippets/pipeline/deepspeed_tied.out"
```

```text
--8<-- "snippets/zero3/soft_inputs_outside.out"
```

```text
  step 1: loss 2.6108, max |stage 0 copy - stage 1 copy| 0.0000
```

`layer1.weight` and [issue #1047](https://example.org/42/99.5) are names.
"""


def test_the_gate_passes_what_the_outputs_show():
    failures, _ = check_page("synthetic.md", SYNTHETIC_PAGE.split("\n"), [])
    # `(0,)` is the only literal neither output prints.
    assert len(failures) == 1 and "code span `(0,)`" in failures[0] and "synthetic.md:5" in failures[0]


@pytest.mark.parametrize("typed, shown, reported", [
    ("`3.8160`", "`3.8161`", "synthetic.md:3: code span `3.8161`"),
    ("is 2.8627", "is 2.8628", "synthetic.md:3: prose number `2.8628`"),
    ("loss 2.6108,", "loss 2.6109,", "synthetic.md:16: typed block line `step 1: loss 2.6109,"),
    # a message split over two lines of the page
    ("`RuntimeError: mat2", "`RuntimeError: mat3", "synthetic.md:4: code span `RuntimeError: mat3 must be a matrix`"),
])
def test_changing_one_digit_fails(typed, shown, reported):
    page = SYNTHETIC_PAGE.replace(typed, shown)
    assert page != SYNTHETIC_PAGE
    failures, _ = check_page("synthetic.md", page.split("\n"), [])
    assert len(failures) == 2, failures
    assert any(reported in failure for failure in failures), failures


def test_an_allowlist_entry_needs_a_reason(tmp_path):
    allowlist = tmp_path / "allow.tsv"
    allowlist.write_text("# a comment\n\nsynthetic.md\t(0,)\t\nsynthetic.md\t(0,)\n*\t1e-6\ttolerance\n")
    entries, problems = read_allowlist(allowlist)
    assert [entry.literal for entry in entries] == ["1e-6"]
    assert "has no reason" in problems[0] and "got 2 field(s)" in problems[1]
    failures, used = check_page("synthetic.md", SYNTHETIC_PAGE.split("\n"), [Allowed(1, "synthetic.md", "(0,)", "r")])
    assert not failures and used == {Allowed(1, "synthetic.md", "(0,)", "r")}
