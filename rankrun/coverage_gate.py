"""Pytest plugin: every line of every snippet must run in some rank during the suite.

An example line that no run executes is an untested claim, so the whole suite fails
when one is left (FastAPI gates its docs_src/ the same way). Coverage is measured inside
the rank processes (rankrun/rank_main.py), not in the test process, and only in the runs that can
still add a line (rankrun.snippet_coverage). The gate is on when the
whole suite runs (`pytest` with no paths and no -k, and no -m other than `not slow`, as
`python3 tasks.py test` and `python3 tasks.py test --quick` do),
and can be forced on or off with --snippet-coverage / --no-snippet-coverage. Exclude a
line only with `# pragma: no cover` and a comment saying why (e.g. a GPU-only branch).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from rankrun import snippet_coverage
from rankrun.runner import ROOT, SNIPPETS, close_pools


def pytest_addoption(parser):
    group = parser.getgroup("snippet coverage")
    group.addoption("--snippet-coverage", action="store_true", default=None,
                    help="fail the session unless every line in snippets/ ran in some rank")
    group.addoption("--no-snippet-coverage", action="store_false", dest="snippet_coverage",
                    help="do not measure snippet coverage")
    group.addoption("--snippet-coverage-data", default=None, metavar="DIR",
                    help="measure snippet coverage without a verdict and keep the lines seen in DIR (a shard of the "
                         "hosted CI); `python -m rankrun.snippet_coverage DIR...` gives the verdict on their union")


# The marker expressions that still run every example: the whole suite, and --quick.
EVERY_EXAMPLE = {"", "not slow"}


def gate_is_on(config) -> bool:
    return why_gate(config)[0]


def why_gate(config) -> tuple[bool, str]:
    """Whether the gate is on, and why, in words for the report header."""
    chosen = config.getoption("snippet_coverage")
    if chosen is not None:
        return chosen, "--snippet-coverage" if chosen else "--no-snippet-coverage"
    if config.getoption("changed"):
        return False, "--changed runs only what the change affects"
    if getattr(config, "shard", None):
        return False, ("--shard runs part of the suite; with --snippet-coverage-data, "
                       "`python -m rankrun.snippet_coverage` judges the shards' union")
    if config.getoption("collectonly"):
        return False, "--collect-only runs no example"
    if not selects_every_test_file(config):
        return False, f"only part of tests/ was selected ({' '.join(config.args)}); --snippet-coverage turns it on"
    if config.getoption("keyword"):
        return False, f"-k {config.getoption('keyword')!r} selects part of the tests; --snippet-coverage turns it on"
    if config.getoption("markexpr") not in EVERY_EXAMPLE:
        return False, f"-m {config.getoption('markexpr')!r} may leave out examples; --snippet-coverage turns it on"
    return True, "the whole suite runs every example"


def selects_every_test_file(config) -> bool:
    """pytest was pointed at all of tests/: no paths from the repository root (testpaths),
    or the repository root or tests/ itself, from any directory."""
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        return True
    targets = {(Path(config.invocation_params.dir) / arg).resolve() for arg in config.args}
    return bool(targets) and targets <= {ROOT.resolve(), (ROOT / "tests").resolve()}


def pytest_report_header(config):
    on, why = why_gate(config)
    return f"snippet coverage gate: {'on' if on else 'off'} ({why})"


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # A pytest-xdist worker: its ranks write to the directory the main process chose
        # (SNIPPET_COVERAGE_DATA, inherited); the main process checks the gate at the end.
        return
    kept = config.getoption("snippet_coverage_data")
    if kept:
        # A part of the suite measured for a verdict on the union of parts: the lines seen are kept.
        Path(kept).mkdir(parents=True, exist_ok=True)
        os.environ[snippet_coverage.DATA] = os.path.join(os.path.abspath(kept), ".coverage")
        return
    if not gate_is_on(config):
        return
    config.snippet_coverage_dir = tempfile.mkdtemp(prefix="snippet-coverage-")
    # Rank processes inherit this and measure themselves (rankrun/rank_main.py).
    os.environ[snippet_coverage.DATA] = os.path.join(config.snippet_coverage_dir, ".coverage")


NOT_MEASURED = snippet_coverage.NOT_MEASURED


def missing_lines() -> dict[str, list[int]]:
    """Snippet file -> line numbers no rank executed."""
    measured = snippet_coverage.measured_files()
    return {measured[path]: sorted(lines) for path, lines in sorted(snippet_coverage.missing(measured).items())}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not hasattr(config, "snippet_coverage_dir") or exitstatus not in (0, 1):
        return
    close_pools()  # every job's lines are written before its worker answers
    missing = missing_lines()
    config.snippet_coverage_missing = missing
    if missing:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def traced_runs(config) -> str:
    """What the gate cost: how many runs were traced, and how many not."""
    decisions = snippet_coverage.decisions()
    traced = sum(1 for d in decisions if d["ranks"] != "none")
    return (f"measured in {traced} of {len(decisions)} runs; {len(decisions) - traced} not traced: every line "
            f"of their files already seen")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    kept = config.getoption("snippet_coverage_data")
    if kept and not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"snippet coverage: lines seen kept in {kept} for the verdict on the union "
                                    f"(python -m rankrun.snippet_coverage); {traced_runs(config)}")
        return
    missing = getattr(config, "snippet_coverage_missing", None)
    if missing is None:
        return
    if not missing:
        terminalreporter.write_line("snippet coverage: 100% of the lines in snippets/ ran in some rank; "
                                    + traced_runs(config)
                                    + "".join(f"; not measured: {path} ({why})" for path, why in NOT_MEASURED.items()))
        return
    terminalreporter.write_sep("=", "snippet coverage gate failed", red=True)
    terminalreporter.write_line(f"snippet coverage: {traced_runs(config)}")
    for path, lines in missing.items():
        terminalreporter.write_line(f"{path}: lines never run in any rank: {', '.join(map(str, lines))}")

