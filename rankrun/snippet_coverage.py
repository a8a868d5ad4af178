"""Which runs measure snippet coverage, and what they saw: every line under snippets/ measured in
as few runs as the gate (rankrun/coverage_gate.py) needs, with the same verdict as tracing every
rank of every run.

Tracing costs a traced rank about 40% more CPU (every Python call in torch and DeepSpeed goes
through the tracer), so a run is traced only while it can still add a line:

- A run's files: its snippet, the snippet modules it imports from its own directory (and theirs),
  and the snippet files it names in a string (gather_timeline.py loads "language_model.py" with
  runpy).
- While one of those files has a line that no traced rank has run in this session, the run is
  traced on every rank, and each rank writes the lines it ran (`seen/`), which every later decision
  reads. Once every line of them has been seen, no later run can add one: it is not traced.

So a line that no rank of any run executed still fails the gate, and a line some rank executed
passes it. (Tracing fewer ranks, or skipping a run of an example at another rank count, would need
the gate to make runs again at the end to stay exact; measured on the pipeline examples, that cost
more than it saved.) The layout, in the directory of SNIPPET_COVERAGE_DATA (the session's):
`seen/*.json` ({file: [lines]} per traced rank), `decisions.jsonl` (one line per run: traced or
not), for the summary.

A part of the suite (a shard of the hosted CI, `--snippet-coverage-data DIR`) decides the same way
within itself and keeps what it saw in DIR; `python -m rankrun.snippet_coverage DIR [DIR ...]`
gives the verdict on the union (standard library and coverage.py only): the union holds every line
a rank of any part ran, so it is the whole suite's verdict.
"""

from __future__ import annotations

import ast
import json
import os
import re
from functools import cache
from pathlib import Path

from rankrun.project import ROOT, SNIPPETS

DATA = "SNIPPET_COVERAGE_DATA"
# In a rank's environment: the ranks to trace, "all" or comma-separated ranks; unset, none.
RANKS = "SNIPPET_COVERAGE_RANKS"
# A line excluded from the gate besides `# pragma: no cover`: after the line that raises, in an
# example that demonstrates a failure.
NEVER_REACHED = r"#\s*never reached"


# Examples whose lines the gate cannot see whole yet, each with why (said in the summary too).
NOT_MEASURED = {
    "snippets/zero3/check_shared_reads.py": "the checker also runs inside the test process and as a "
                                            "command in a subprocess, neither of which the gate measures",
}


def measured_files() -> dict[str, str]:
    """Every snippet file the gate measures: absolute path -> path from the repository root."""
    return {str(snippet.resolve()): str(snippet.relative_to(ROOT)) for snippet in sorted(SNIPPETS.rglob("*.py"))
            if str(snippet.relative_to(ROOT)) not in NOT_MEASURED}


def directory() -> Path | None:
    data = os.environ.get(DATA)
    return Path(data).parent if data else None


def traced_here() -> bool:
    """Whether this rank traces its snippet (rankrun/rank_main.py asks, with RANK in its environment)."""
    chosen = os.environ.get(RANKS, "")
    return bool(os.environ.get(DATA)) and (chosen == "all" or os.environ.get("RANK", "0") in chosen.split(","))


def record_seen(lines: dict[str, list[int]]) -> None:
    """A traced rank's lines, {file: [line numbers]}, for the decisions of every later run."""
    seen = directory() / "seen"
    seen.mkdir(exist_ok=True)
    partial = seen / f".{os.getpid()}.{os.urandom(4).hex()}"
    partial.write_text(json.dumps(lines))
    partial.rename(seen / f"{partial.name[1:]}.json")  # whole files only, for a reader in another process


def lines_of(measured) -> dict[str, list[int]]:
    """What a stopped coverage.Coverage measured: {file: sorted line numbers}."""
    data = measured.get_data()
    return {path: sorted(data.lines(path) or ()) for path in data.measured_files()}


# --- statements, and the files a run can execute -----------------------------------------------

@cache
def statements(path: str) -> frozenset[int]:
    """The lines of a snippet file that the gate asks for: coverage.py's statements, less
    `# pragma: no cover` and `# never reached` lines."""
    import coverage

    measured = coverage.Coverage(data_file=None, config_file=False)
    measured.exclude(NEVER_REACHED)
    _, lines, _, _, _ = measured.analysis2(path)
    return frozenset(lines)


NAMED_FILE = re.compile(r"^[\w.-]+\.py$")


@cache
def files_of(path: str) -> frozenset[str]:
    """The snippet files a run of `path` can execute (see the module docstring), as absolute paths."""
    found: set[str] = set()
    todo = [Path(path).resolve()]
    while todo:
        current = todo.pop()
        if str(current) in found or not current.is_file():
            continue
        found.add(str(current))
        try:
            tree = ast.parse(current.read_text())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED_FILE.match(node.value):
                todo += [other.resolve() for other in SNIPPETS.rglob(node.value)]
            todo += [current.parent / f"{name}.py" for name in names if (current.parent / f"{name}.py").is_file()]
    return frozenset(path for path in found if Path(path).is_relative_to(SNIPPETS.resolve()))


class Seen:
    """The lines traced ranks ran in this session, read incrementally from `seen/`."""

    def __init__(self):
        self.read: set[str] = set()
        self.lines: dict[str, set[int]] = {}

    def update(self, where: Path | None = None) -> dict[str, set[int]]:
        where = where or directory()
        if where is not None and (where / "seen").is_dir():
            for record in (where / "seen").glob("*.json"):
                if str(record) in self.read:
                    continue
                self.read.add(str(record))
                for path, lines in json.loads(record.read_text()).items():
                    self.lines.setdefault(path, set()).update(lines)
        return self.lines

    def unseen(self, paths) -> dict[str, set[int]]:
        lines = self.update()
        missing = {path: set(statements(path)) - lines.get(path, set()) for path in paths}
        return {path: left for path, left in missing.items() if left}


_SEEN = Seen()


@cache
def _measured() -> frozenset[str]:
    """The files the gate judges (NOT_MEASURED left out: a run of an example that imports one of
    them would otherwise always look as if it could add a line)."""
    return frozenset(measured_files())


def ranks_to_trace(snippet: Path, world_size: int) -> str:
    """The ranks to trace, as RANKS takes them: "all" while a file of the run has a line not yet
    seen, else "" (see the module docstring)."""
    return "all" if _SEEN.unseen(files_of(str(snippet)) & _measured()) else ""


# --- the record of the decisions ----------------------------------------------------------------

def log_decision(snippet: Path, world_size: int, ranks: str, kind: str) -> None:
    where = directory()
    if where is None:
        return
    with open(where / "decisions.jsonl", "a") as log:  # one short write: atomic with O_APPEND
        log.write(json.dumps({"snippet": str(snippet), "world_size": world_size, "ranks": ranks or "none",
                              "kind": kind}) + "\n")


def missing(paths) -> dict[str, set[int]]:
    """{file: lines no traced rank ran}, for the files given (absolute paths)."""
    return Seen().unseen(paths)


def decisions() -> list[dict]:
    where = directory()
    log = where / "decisions.jsonl" if where else None
    return [json.loads(line) for line in log.read_text().splitlines() if line] if log and log.exists() else []


def main(directories: list[str]) -> int:
    """The verdict on the union of parts of the suite measured with --snippet-coverage-data (the
    hosted CI's shards): exit 1, naming each file and line, when a line ran in no rank of any part."""
    if not directories:
        print("usage: python -m rankrun.snippet_coverage DIR [DIR ...]  (each written by --snippet-coverage-data)")
        return 2
    seen = Seen()
    for part in directories:
        if not (Path(part) / "seen").is_dir():
            print(f"{part}: no lines seen there (not written by --snippet-coverage-data?)")
            return 2
        seen.update(Path(part))
    names = measured_files()
    missing = seen.unseen(names)
    for path, lines in sorted(missing.items()):
        print(f"{names[path]}: lines never run in any rank: {', '.join(map(str, sorted(lines)))}")
    if missing:
        return 1
    print(f"snippet coverage: 100% of the lines in snippets/ ran in some rank of {len(directories)} parts")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
