"""The data of "Find your error" and "What readers report, by cause": reading and validation
(hooks/errors_pages.py renders the pages from it; this module is not a hook itself).

The data, under docs/errors/:
- messages.toml: the entries of "Find your error", one per message a run printed (one per
  symptom for hangs and silent errors), each with its cause or causes, the section with the
  fix and the releases; causes the census has not named yet are proposed there too;
- causes.toml: the causes behind readers' public threads (the census);
- threads/*.toml: the threads, one file per repository (or forum), each naming one cause.

Invalid data stops the build with one line per problem: the file, the entry and what is
wrong (`validate`). Anchors are computed as the build computes them: Markdown's toc
extension, fenced blocks skipped with rankrun.pages' reader.
"""

from __future__ import annotations

import html
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

STATUSES = ("run", "source", "unanswered")
KINDS = {"issue": "issues", "pull": "pull", "discussion": "discussions", "forum": None}
THREAD_FIELDS = ("id", "kind", "url", "title", "message", "symptom", "path", "releases", "cause")
CAUSE_FIELDS = ("title", "answer", "status", "tell")
PROPOSED_FIELDS = ("title", "answer")
ENTRY_FIELDS = ("message", "symptom", "cause")
ENTRY_CAUSE_FIELDS = ("id", "section", "releases", "tell", "output", "source", "evidence")
GITHUB_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)#(?P<number>\d+)$")
# The exception's name at the start of a message: the group of "Find your error" it goes in.
EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(?P<name>\w+(?:Error|Exception|Warning))\b")


class DataError(Exception):
    """Invalid data: one line per problem."""


@dataclass
class Cause:
    id: str
    title: str
    answer: str  # "page.md#anchor" relative to docs/, or ""
    status: str  # run, source, unanswered
    tell: str = ""
    proposed: bool = False  # named in messages.toml, not yet in the census


@dataclass
class Thread:
    id: str
    kind: str
    url: str
    title: str
    message: str
    symptom: str
    path: str
    releases: str
    cause: str
    file: str

    @property
    def source(self) -> str:
        """The repository (owner/name) or, for a forum, the host."""
        github = GITHUB_ID.match(self.id)
        return github["repo"] if github else self.id.split("/", 1)[0]


@dataclass
class EntryCause:
    id: str
    releases: str
    section: str = ""  # "page.md#anchor"; validate() fills in the cause's answer when left out
    tell: str = ""
    output: str = ""  # the file a run wrote, relative to the project
    source: bool = False  # read from source: the section says so
    evidence: str = ""  # for a symptom: the line of the output that shows it


@dataclass
class Entry:
    key: str  # the message, or the symptom
    is_symptom: bool
    causes: list[EntryCause] = field(default_factory=list)

    @property
    def group(self) -> str:
        if self.is_symptom:
            return "No error: hangs and silent changes"
        match = EXCEPTION.match(self.key)
        return match["name"] if match else "Warnings and other messages"


@dataclass
class Data:
    causes: dict[str, Cause]
    threads: list[Thread]
    entries: list[Entry]

    def threads_of(self, cause: str) -> list[Thread]:
        return [thread for thread in self.threads if thread.cause == cause]


# --- reading ----------------------------------------------------------------------------------

def read_toml(path: Path, root: Path, problems: list[str]) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        problems.append(f"{path.relative_to(root)}: not valid TOML: {error}")
        return {}


def fields_of(where: str, table, allowed, required, problems) -> dict | None:
    """The table's string fields, after checking that it is a table, names no unknown field and
    has every required one as a string (booleans are allowed where a default is False)."""
    if not isinstance(table, dict):
        problems.append(f"{where}: expected a table, got {type(table).__name__}")
        return None
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        problems.append(f"{where}: unknown field {', '.join(map(repr, unknown))} (allowed: {', '.join(allowed)})")
    missing = [name for name in required if name not in table]
    if missing:
        problems.append(f"{where}: missing field {', '.join(map(repr, missing))}")
    wrong = [name for name, value in table.items() if name in allowed and name != "cause"
             and not isinstance(value, (bool if name == "source" else str))]
    if wrong:
        problems.append(f"{where}: field {', '.join(map(repr, wrong))} must be "
                        + ("true or false" if wrong == ["source"] else "a string"))
    return None if unknown or missing or wrong else table


def load(docs: Path, root: Path) -> tuple[Data, list[str]]:
    """The data under docs/errors/, and the problems found while reading it."""
    problems: list[str] = []
    folder = docs / "errors"
    causes: dict[str, Cause] = {}
    for name, table in read_toml(folder / "causes.toml", root, problems).get("cause", {}).items():
        where = f"docs/errors/causes.toml: cause {name!r}"
        if fields_of(where, table, CAUSE_FIELDS, CAUSE_FIELDS, problems) is not None:
            causes[name] = Cause(name, **table)
    messages = read_toml(folder / "messages.toml", root, problems)
    unknown_tables = sorted(set(messages) - {"cause", "entry"})
    if unknown_tables:
        problems.append(f"docs/errors/messages.toml: unknown table {', '.join(unknown_tables)} (allowed: cause, entry)")
    for name, table in messages.get("cause", {}).items():
        where = f"docs/errors/messages.toml: proposed cause {name!r}"
        if fields_of(where, table, PROPOSED_FIELDS, PROPOSED_FIELDS, problems) is not None and name not in causes:
            # The census's own table wins once it names the cause (a test says to remove this one).
            causes[name] = Cause(name, table["title"], table["answer"], "run", proposed=True)
    threads = []
    for path in sorted((folder / "threads").glob("*.toml")):
        for index, table in enumerate(read_toml(path, root, problems).get("thread", [])):
            where = f"docs/errors/threads/{path.name}: thread {table.get('id', f'number {index + 1}')!r}" \
                if isinstance(table, dict) else f"docs/errors/threads/{path.name}: thread number {index + 1}"
            if fields_of(where, table, THREAD_FIELDS, THREAD_FIELDS, problems) is not None:
                threads.append(Thread(**table, file=path.name))
    entries = []
    for index, table in enumerate(messages.get("entry", [])):
        key = table.get("message") or table.get("symptom") if isinstance(table, dict) else None
        where = f"docs/errors/messages.toml: entry {key!r}" if key else f"docs/errors/messages.toml: entry number {index + 1}"
        if fields_of(where, table, ENTRY_FIELDS, ("cause",), problems) is None:
            continue
        if ("message" in table) == ("symptom" in table) or not key:
            problems.append(f"{where}: give either `message` (exactly as a run printed it) or `symptom`, not both")
            continue
        entry = Entry(key, "symptom" in table)
        if not isinstance(table["cause"], list) or not table["cause"]:
            problems.append(f"{where}: needs at least one [[entry.cause]]")
        for number, cause in enumerate(table["cause"] if isinstance(table["cause"], list) else []):
            cause_where = f"{where}, cause {cause.get('id', number + 1)!r}" if isinstance(cause, dict) else where
            if fields_of(cause_where, cause, ENTRY_CAUSE_FIELDS, ("id", "releases"), problems) is not None:
                entry.causes.append(EntryCause(**cause))
        entries.append(entry)
    return Data(causes, threads, entries), problems


# --- the sections of the pages --------------------------------------------------------------

HEADING = re.compile(r"^(?P<hashes>#{1,6})\s+(?P<text>.+?)(?:\s+#+)?\s*$")
ATTRIBUTES = re.compile(r"\s*\{(?P<attrs>[^{}]*)\}\s*$")


def heading_text(markdown: str) -> str:
    """A heading's text as the toc extension sees it: code spans, links and emphasis as text."""
    parts = re.split(r"((?<!`)`+)(?!`)(.+?)(?<!`)\1(?!`)", markdown)
    shown = []
    for index in range(0, len(parts), 3):  # text, then a code span's fence and content
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", parts[index])
        text = re.sub(r"(\*\*|__|\*)(?=\S)(.+?)(?<=\S)\1", r"\2", text)
        shown.append(html.unescape(text))
        if index + 2 < len(parts):
            content = parts[index + 2]
            shown.append(content[1:-1] if content.startswith(" ") and content.endswith(" ") and content.strip()
                         else content)
    return "".join(shown)


def headings(path: Path) -> tuple[str, dict[str, str]]:
    """A page's title and {anchor: heading text} of its headings, anchored as the toc extension
    anchors them (slugify, `_1` for a repeat, an explicit `{#id}`)."""
    from markdown.extensions.toc import slugify, unique

    from rankrun.pages import fenced_blocks

    lines = path.read_text().split("\n")
    if lines and lines[0] == "---":  # front matter
        end = lines.index("---", 1)
        lines = [""] * (end + 1) + lines[end + 1:]
    in_code = set()
    for start, end in fenced_blocks(lines):
        in_code.update(range(start, end + 1))
    title, anchors, seen = "", {}, set()
    for index, line in enumerate(lines):
        match = HEADING.match(line)
        if not match or index in in_code:
            continue
        text, explicit = match["text"], None
        attributes = ATTRIBUTES.search(text)
        if attributes:
            explicit = next((part[1:] for part in attributes["attrs"].split() if part.startswith("#")), None)
            text = text[:attributes.start()]
        shown = heading_text(text)
        anchor = unique(explicit or slugify(shown, "-"), seen)
        anchors[anchor] = shown
        if len(match["hashes"]) == 1 and not title:
            title = shown
    return title, anchors


def section_title(docs: Path, target: str, cache: dict) -> str | None:
    """The words a link to `page.md#anchor` shows: the page's title, then the section's heading;
    None when the page or the anchor does not exist."""
    page, _, anchor = target.partition("#")
    path = docs / page
    if not page.endswith(".md") or not path.is_file():
        return None
    if page not in cache:
        cache[page] = headings(path)
    title, anchors = cache[page]
    if not anchor:
        return title
    if anchor not in anchors:
        return None
    return title if anchors[anchor] == title else f"{title} › {anchors[anchor]}"


# --- validation -------------------------------------------------------------------------------

def validate(data: Data, docs: Path, root: Path) -> list[str]:
    """Every problem of the data that the pages would otherwise show wrong or not at all."""
    problems, cache = [], {}

    def check_section(where: str, target: str) -> None:
        if section_title(docs, target, cache) is None:
            page, _, anchor = target.partition("#")
            if not (docs / page).is_file() or not page.endswith(".md"):
                problems.append(f"{where}: {target!r}: there is no page docs/{page}")
            else:
                known = ", ".join(sorted(cache[page][1])) or "none"
                problems.append(f"{where}: {target!r}: docs/{page} has no heading with the anchor "
                                f"{anchor!r} (its anchors: {known})")

    for cause in data.causes.values():
        where = ("docs/errors/messages.toml: proposed cause" if cause.proposed
                 else "docs/errors/causes.toml: cause") + f" {cause.id!r}"
        if cause.status not in STATUSES:
            problems.append(f"{where}: status {cause.status!r} is not one of {', '.join(STATUSES)}")
        if cause.status in ("run", "source") and not cause.answer:
            problems.append(f"{where}: status {cause.status!r} needs an answer (\"page.md#anchor\")")
        if cause.answer:
            check_section(where, cause.answer)
    seen: dict[str, str] = {}
    for thread in data.threads:
        where = f"docs/errors/threads/{thread.file}: thread {thread.id!r}"
        if thread.id in seen:
            problems.append(f"{where}: the same id is also in docs/errors/threads/{seen[thread.id]}")
        seen.setdefault(thread.id, thread.file)
        if thread.cause not in data.causes:
            problems.append(f"{where}: unknown cause {thread.cause!r} (the causes are the tables of "
                            "docs/errors/causes.toml)")
        if not (thread.message or thread.symptom):
            problems.append(f"{where}: give its `message` or, if it has none, its `symptom`")
        if thread.kind not in KINDS:
            problems.append(f"{where}: kind {thread.kind!r} is not one of {', '.join(KINDS)}")
        github = GITHUB_ID.match(thread.id)
        if github:
            expected = f"https://github.com/{github['repo']}/{KINDS.get(thread.kind)}/{github['number']}"
            if thread.kind in KINDS and not KINDS[thread.kind]:
                problems.append(f"{where}: a GitHub thread's kind is issue, pull or discussion, not {thread.kind!r}")
            elif thread.kind in KINDS and thread.url.lower() != expected.lower():
                problems.append(f"{where}: url {thread.url!r} is not its {thread.kind}'s address {expected!r}")
            expected_file = github["repo"].replace("/", "-") + ".toml"
        elif thread.kind == "forum" and thread.url == f"https://{thread.id}":
            expected_file = thread.id.split("/", 1)[0] + ".toml"
        else:
            problems.append(f"{where}: an id is \"owner/repo#N\" (a GitHub issue or pull request), or a forum "
                            f"thread's address without https:// (its url, {thread.url!r}, with it)")
            continue
        if thread.file != expected_file:
            problems.append(f"{where}: belongs in docs/errors/threads/{expected_file} (one file per repository)")
    keys: set[str] = set()
    for entry in data.entries:
        where = f"docs/errors/messages.toml: entry {entry.key!r}"
        if entry.key in keys:
            problems.append(f"{where}: a second entry for the same {'symptom' if entry.is_symptom else 'message'}")
        keys.add(entry.key)
        pairs = set()
        for cause in entry.causes:
            cause_where = f"{where}, cause {cause.id!r}"
            known = data.causes.get(cause.id)
            if known is None:
                problems.append(f"{cause_where}: unknown cause (name it in docs/errors/causes.toml, or propose "
                                "it in a [cause.<id>] table of messages.toml)")
                continue
            if not cause.section:
                if not known.answer:
                    problems.append(f"{cause_where}: the cause has no answer yet; give `section`, or leave the "
                                    "cause out of this entry until its section exists")
                    continue
                cause.section = known.answer
            check_section(cause_where, cause.section)
            if (cause.id, cause.section) in pairs:
                problems.append(f"{cause_where}: listed twice with the same section")
            pairs.add((cause.id, cause.section))
            if len(entry.causes) > 1 and not cause.tell:
                problems.append(f"{cause_where}: the message has {len(entry.causes)} causes; say in `tell` how a "
                                "reader tells this one from the others")
            if bool(cause.output) == cause.source:
                problems.append(f"{cause_where}: give `output` (the file a run printed it in) or `source = true` "
                                "(read from source, and its section says so), one of them")
            elif cause.output:
                path = root / cause.output
                shown = cause.evidence if entry.is_symptom else entry.key
                if entry.is_symptom and not cause.evidence:
                    problems.append(f"{cause_where}: a symptom needs `evidence`, the line of {cause.output} that shows it")
                elif not path.is_file():
                    problems.append(f"{cause_where}: there is no file {cause.output}")
                elif shown not in path.read_text():
                    problems.append(f"{cause_where}: {cause.output} does not contain {shown!r} verbatim")
            if cause.evidence and not entry.is_symptom:
                problems.append(f"{cause_where}: `evidence` is for symptoms; a message is its own evidence")
    return problems


def load_valid(docs: Path, root: Path) -> Data:
    data, problems = load(docs, root)
    problems += validate(data, docs, root) if not problems else []
    if problems:
        raise DataError(f"{len(problems)} problem(s) in docs/errors/, the data of \"Find your error\" and "
                        "the census:\n" + "\n".join(f"  - {problem}" for problem in problems))
    return data
