"""MkDocs hook: "Find your error" and "What readers report, by cause", rendered from data.

docs/errors/index.md and docs/errors/census.md hold their prose and one marker line each
(MARKERS). At every build this hook reads docs/errors/ (messages.toml, causes.toml,
threads/*.toml; hooks/errors_data.py reads and validates them) and replaces each marker with
Markdown: the entries of "Find your error" (message, cause or causes with how to tell them
apart, the section with the fix, the releases, the run that printed it), and the census (every
cause with its threads, by number of threads, and the totals). Invalid data stops the build
with one line per problem. tests/test_errors_data.py checks the validation and the rendering;
tests/site/test_find_your_error.py checks the built pages, their links and the search box.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

from mkdocs.exceptions import PluginError


def _sibling(name: str):
    """hooks/<name>.py as a module (MkDocs loads hooks by path; hooks/ is no package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while it is executed
        spec.loader.exec_module(module)
    return sys.modules[name]


errors_data = _sibling("errors_data")

MARKERS = {
    "errors/index.md": "<!-- the entries of docs/errors/messages.toml, rendered by hooks/errors_pages.py -->",
    "errors/census.md": "<!-- the census, docs/errors/causes.toml and threads/, rendered by hooks/errors_pages.py -->",
}
# Python-Markdown's backslash escapes, plus what starts HTML.
ESCAPED = set("\\`*_{}[]()#+-.!")
NUMBER_WORDS = {2: "Two", 3: "Three", 4: "Four", 5: "Five"}


def code(text: str) -> str:
    """An inline code span that shows `text` exactly, backticks included."""
    longest = max((len(run) for run in text.split("\n") for run in _backtick_runs(run)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or longest else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _backtick_runs(text: str) -> list[str]:
    runs, current = [], ""
    for character in text:
        if character == "`":
            current += character
        elif current:
            runs.append(current)
            current = ""
    return runs + ([current] if current else [])


def plain(text: str) -> str:
    """`text` as Markdown that renders as exactly that text (no emphasis, links or HTML)."""
    text = " ".join(text.split())
    escaped = "".join("\\" + character if character in ESCAPED else character for character in text)
    return escaped.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def link(docs: Path, target: str, cache: dict, here: str = "errors/") -> str:
    """A Markdown link to `page.md#anchor` (relative to docs/), from a page in `here`, showing
    the page's title and the section's heading."""
    shown = errors_data.section_title(docs, target, cache)
    depth = here.count("/")
    return f"[{plain(shown)}]({'../' * depth}{target})"


def count(number: int, noun: str, plural: str = "") -> str:
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def answer_of(cause, docs: Path, cache: dict) -> str:
    """What answers a cause on this site, in words, with the link."""
    if cause.status == "run":
        return f"{link(docs, cause.answer, cache)} (a run shows it)"
    if cause.status == "source":
        return f"{link(docs, cause.answer, cache)} (read from upstream source, not run)"
    related = f"; related: {link(docs, cause.answer, cache)}" if cause.answer else ""
    return f"not answered yet{related}"


# --- "Find your error" ------------------------------------------------------------------------

def entry_cause_lines(data, entry, cause, docs: Path, cache: dict) -> list[str]:
    known = data.causes[cause.id]
    lines = []
    if len(entry.causes) > 1 or cause.tell:
        lines.append(f"**How to tell:** {plain(cause.tell)}")
    lines.append(f"**Fix:** {link(docs, cause.section, cache)}")
    if cause.source:
        lines.append(f"**Read from source**, not printed by a run here (the section says so): "
                     f"{plain(cause.releases)}")
    elif entry.is_symptom:
        lines.append(f"**Shown by a run:** {code(cause.evidence)} in {code(cause.output)}, "
                     f"on {plain(cause.releases)}")
    else:
        lines.append(f"**Printed by a run:** {code(cause.output)}, on {plain(cause.releases)}")
    threads = len(data.threads_of(cause.id))
    if threads:
        lines.append(f"**Readers' threads with this cause:** [{threads}](census.md#{known.id})")
    return lines


def render_entries(data, docs: Path) -> str:
    """The entries of "Find your error", grouped by exception, in the order of messages.toml."""
    cache: dict = {}
    groups: dict[str, list] = {}
    for entry in data.entries:
        groups.setdefault(entry.group, []).append(entry)
    special = ["Warnings and other messages", "No error: hangs and silent changes"]
    order = sorted(name for name in groups if name not in special) + [name for name in special if name in groups]
    out = []
    for name in order:
        # A group's heading is no search result of its own: "KeyError" alone would outrank the
        # entry of a reader's `KeyError: 'x'` that the site does not have.
        out.append(f"## {plain(name)} {{ data-search-exclude }}\n")
        for entry in groups[name]:
            out.append(f"### {code(entry.key) if not entry.is_symptom else plain(entry.key)}\n")
            if len(entry.causes) == 1:
                cause = entry.causes[0]
                out.append(f"- **Cause:** {plain(data.causes[cause.id].title)}")
                out += [f"- {line}" for line in entry_cause_lines(data, entry, cause, docs, cache)]
            else:
                words = NUMBER_WORDS.get(len(entry.causes), str(len(entry.causes)))
                what = "symptom" if entry.is_symptom else "message"
                out.append(f"{words} cases give this {what}; **how to tell** says which one you have.\n")
                for number, cause in enumerate(entry.causes, 1):
                    out.append(f"{number}. **Cause:** {plain(data.causes[cause.id].title)}")
                    out += [f"    - {line}" for line in entry_cause_lines(data, entry, cause, docs, cache)]
            out.append("")
    return "\n".join(out)


# --- the census -------------------------------------------------------------------------------

def totals(data) -> dict[str, int]:
    sources = {thread.source for thread in data.threads}
    forums = {thread.source for thread in data.threads if thread.kind == "forum"}
    census = [cause for cause in data.causes.values() if not cause.proposed]
    return {
        "threads": len(data.threads),
        "repositories": len(sources - forums),
        "forums": len(forums),
        "causes": len(census),
        "causes with threads": len({thread.cause for thread in data.threads}),
        **{f"causes {status}": sum(cause.status == status for cause in census) for status in errors_data.STATUSES},
    }


def thread_lines(thread) -> list[str]:
    said = (f"message: {code(thread.message)}" if thread.message else f"symptom: {plain(thread.symptom)}")
    where = "; ".join(part for part in (f"path: {plain(thread.path)}" if thread.path else "",
                                          f"releases: {plain(thread.releases)}" if thread.releases else "") if part)
    return [f"- [{plain(thread.id)}]({thread.url}) ({thread.kind}): {plain(thread.title)}  ",
            f"  {said[0].upper()}{said[1:]}" + (f"  \n  {where[0].upper()}{where[1:]}" if where else "")]


def render_census(data, docs: Path) -> str:
    """Every cause of the census with its threads, most threads first, and the totals."""
    cache: dict = {}
    numbers = totals(data)
    per_cause = Counter(thread.cause for thread in data.threads)
    forums = f" and {count(numbers['forums'], 'forum')}" if numbers["forums"] else ""
    out = [
        f"**{count(numbers['threads'], 'thread')}** from {count(numbers['repositories'], 'repository', 'repositories')}"
        f"{forums}, under **{count(numbers['causes'], 'cause')}**; {numbers['causes with threads']} of the causes "
        f"have at least one thread. Answered on this site: {numbers['causes run']} by a run, "
        f"{numbers['causes source']} from upstream source only; {numbers['causes unanswered']} not yet.\n",
        "## The causes, by number of threads\n",
    ]
    order = list(data.causes)
    census = [cause for cause in data.causes.values() if not cause.proposed]
    for cause in sorted(census, key=lambda c: (-per_cause[c.id], order.index(c.id))):
        threads = data.threads_of(cause.id)
        out.append(f"### {plain(cause.title)} {{#{cause.id}}}\n")
        out.append(f"**{count(len(threads), 'thread')}.** Answer: {answer_of(cause, docs, cache)}.\n")
        if cause.tell:
            out.append(f"How to tell it from a cause with the same message: {plain(cause.tell)}\n")
        for thread in threads:
            out += thread_lines(thread)
        out.append("")
    return "\n".join(out)


# --- the hook ---------------------------------------------------------------------------------

DATA = {}


def on_pre_build(config):
    docs = Path(config.docs_dir)
    try:
        DATA["data"] = errors_data.load_valid(docs, Path(config.config_file_path).parent)
    except errors_data.DataError as error:
        raise PluginError(str(error)) from None


def on_page_markdown(markdown, page, config, files):
    marker = MARKERS.get(page.file.src_uri)
    if marker is None:
        return markdown
    if marker not in markdown.split("\n"):
        raise PluginError(f"docs/{page.file.src_uri} has lost its marker line, where hooks/errors_pages.py "
                          f"puts what it renders: {marker}")
    render = render_entries if page.file.src_uri == "errors/index.md" else render_census
    return markdown.replace(marker, render(DATA["data"], Path(config.docs_dir)), 1)
