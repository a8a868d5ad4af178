"""Which runs measure snippet coverage, and what they saw: every line under snippets/ measured in
as few runs as the gate (rankrun/coverage_gate.py) needs, with the same verdict as tracing every
rank of every run.

Tracing costs a traced rank about 40% more CPU (every Python call in torch and DeepSpeed goes
through the tracer), so a run is traced only while it can still add a line, and only on the ranks
that can:

- A run's files: its snippet, the snippet modules it imports from its own directory (and theirs),
  and the snippet files it names in a string (gather_timeline.py loads "language_model.py" with
  runpy).
- Once every line of a run's files has been seen by a traced rank in this session, no later run
  can add one: it is not traced.
- Otherwise it is traced on its first and last rank (all of a 1- or 2-rank run): rank 0 prints and
  saves, the last rank is the last pipeline stage; the ranks between run what one of them runs in
  almost every example. A traced rank writes the lines it ran (`seen/`).
- A run of the same snippet, entry point and environment as one already traced, at another rank
  count, is not traced: it runs the same lines but for a branch on the rank count (a refusal, a
  middle pipeline stage).
- A run with a rank that was not traced and ended by itself is recorded (`partial/`). At the end
  of the session, for each file that still misses a line, the gate makes the recorded runs that
  can execute that file again, with every rank traced, cheapest first (fewest ranks), until the
  file misses nothing, before it reports: the line a refusal reaches at 3 ranks, or that only a
  middle rank runs, is seen then. (A rank the runner killed, its peer having failed first, saves
  nothing in any run, so it is not a reason to make a run again.)

So a line no rank of any run executed still fails the gate, and a line some rank executed passes
it. The layout, in the directory of SNIPPET_COVERAGE_DATA (the session's): `seen/*.json` ({file:
[lines]} per traced rank), `partial/*.pickle` (a run to make again, with its arguments),
`decisions.jsonl` (one line per run: traced ranks, or why not), for the summary.

A part of the suite (a shard of the hosted CI, `--snippet-coverage-data DIR`) traces every rank
of a run that can add a line, so that no run has to be made again, and keeps what it saw in DIR;
`python -m rankrun.snippet_coverage DIR [DIR ...]` gives the verdict on the union (standard
library and coverage.py only).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import re
from functools import cache
from pathlib import Path

from rankrun.project import ROOT, SNIPPETS

DATA = "SNIPPET_COVERAGE_DATA"
# In a rank's environment: the ranks to trace, "all" or comma-separated ranks; unset, none.
RANKS = "SNIPPET_COVERAGE_RANKS"
# Set (--snippet-coverage-data, a part of the suite): trace every rank of a run that can add a line,
# so that the union of the parts is exact without making a run again.
EVERY_RANK = "SNIPPET_COVERAGE_EVERY_RANK"
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


def ranks_to_trace(snippet: Path, world_size: int, key: str = "") -> str:
    """The ranks to trace, as RANKS takes them: "" (none), "all", or "0,N-1" (see the module docstring).
    `key`: what decides which lines the run reaches besides its rank count (entry point, environment,
    fresh or warm)."""
    if not _SEEN.unseen(files_of(str(snippet)) & _measured()):
        return ""
    if os.environ.get(EVERY_RANK) or world_size <= 2:
        return "all"
    if key and traced_at_another_rank_count(snippet, key):
        return ""
    return f"0,{world_size - 1}"


def _key_marker(snippet: Path, key: str) -> Path:
    name = hashlib.sha256(f"{snippet.resolve()}\0{key}".encode()).hexdigest()[:24]
    return directory() / "traced" / name


def traced_at_another_rank_count(snippet: Path, key: str) -> bool:
    return bool(key) and _key_marker(snippet, key).exists()


def record_traced(snippet: Path, key: str) -> None:
    """A run of `snippet` with `key` was traced (its lines other rank counts of it would reach too)."""
    if key:
        marker = _key_marker(snippet, key)
        marker.parent.mkdir(exist_ok=True)
        marker.touch()


# --- the record of the runs, and making them again ----------------------------------------------

def log_decision(snippet: Path, world_size: int, ranks: str, kind: str) -> None:
    where = directory()
    if where is None:
        return
    with open(where / "decisions.jsonl", "a") as log:  # one short write: atomic with O_APPEND
        log.write(json.dumps({"snippet": str(snippet), "world_size": world_size, "ranks": ranks or "none",
                              "kind": kind}) + "\n")


def record_partial(snippet: Path, world_size: int, arguments: dict) -> None:
    """A run with a rank that was not traced and ended by itself: what the gate needs to make it
    again (rankrun.runner._run_now's arguments), if a file it can execute still misses a line."""
    where = directory() / "partial"
    where.mkdir(exist_ok=True)
    payload = pickle.dumps({"snippet": str(snippet), "world_size": world_size, "arguments": arguments})
    name = hashlib.sha256(payload).hexdigest()[:24]
    (where / f"{name}.pickle").write_bytes(payload)


def partial_runs() -> list[dict]:
    """The recorded runs, cheapest first: fewest ranks, then the snippet's name."""
    where = directory() / "partial"
    records = [pickle.loads(path.read_bytes()) for path in sorted(where.glob("*.pickle"))] if where.is_dir() else []
    return sorted(records, key=lambda record: (record["world_size"], record["snippet"]))


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
