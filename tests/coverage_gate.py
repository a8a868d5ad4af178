"""Pytest plugin: every line of every snippet must run in some rank during the suite.

An example line that no run executes is an untested claim, so the whole suite fails
when one is left (FastAPI gates its docs_src/ the same way). Coverage is measured inside
the rank processes (tests/rank_main.py), not in the test process. The gate is on when the
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

from runner import ROOT, SNIPPETS, close_pools


def pytest_addoption(parser):
    group = parser.getgroup("snippet coverage")
    group.addoption("--snippet-coverage", action="store_true", default=None,
                    help="fail the session unless every line in snippets/ ran in some rank")
    group.addoption("--no-snippet-coverage", action="store_false", dest="snippet_coverage",
                    help="do not measure snippet coverage")


# The marker expressions that still run every example: the whole suite, and --quick.
EVERY_EXAMPLE = {"", "not slow"}


def gate_is_on(config) -> bool:
    chosen = config.getoption("snippet_coverage")
    if chosen is not None:
        return chosen
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    return whole_suite and not config.getoption("keyword") and config.getoption("markexpr") in EVERY_EXAMPLE


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # A pytest-xdist worker: its ranks write to the directory the main process chose
        # (SNIPPET_COVERAGE_DATA, inherited); the main process checks the gate at the end.
        return
    if not gate_is_on(config):
        return
    config.snippet_coverage_dir = tempfile.mkdtemp(prefix="snippet-coverage-")
    # Rank processes inherit this and measure themselves (tests/rank_main.py).
    os.environ["SNIPPET_COVERAGE_DATA"] = os.path.join(config.snippet_coverage_dir, ".coverage")


def missing_lines() -> dict[str, list[int]]:
    """Snippet file -> line numbers no rank executed."""
    import coverage

    directory = os.path.dirname(os.environ["SNIPPET_COVERAGE_DATA"])
    measured = coverage.Coverage(data_file=os.path.join(directory, "combined"), config_file=False)
    # Besides `# pragma: no cover`: lines after the one that raises, in examples that demonstrate a failure.
    measured.exclude(r"#\s*never reached")
    parts = [str(p) for p in Path(directory).glob(".coverage.*")]
    if parts:
        measured.combine(parts, keep=True)
    missing = {}
    for snippet in sorted(SNIPPETS.rglob("*.py")):
        _, _, _, lines, _ = measured.analysis2(str(snippet))
        if lines:
            missing[str(snippet.relative_to(ROOT))] = lines
    return missing


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not hasattr(config, "snippet_coverage_dir") or exitstatus not in (0, 1):
        return
    close_pools()  # every job's data is saved before its worker answers
    missing = missing_lines()
    config.snippet_coverage_missing = missing
    if missing:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    missing = getattr(config, "snippet_coverage_missing", None)
    if missing is None:
        return
    if not missing:
        terminalreporter.write_line("snippet coverage: 100% of the lines in snippets/ ran in some rank")
        return
    terminalreporter.write_sep("=", "snippet coverage gate failed", red=True)
    for path, lines in missing.items():
        terminalreporter.write_line(f"{path}: lines never run in any rank: {', '.join(map(str, lines))}")
