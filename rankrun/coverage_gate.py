"""Pytest plugin: every line of every snippet must run in some rank during the suite.

An example line that no run executes is an untested claim, so the whole suite fails
when one is left (FastAPI gates its docs_src/ the same way). Coverage is measured inside
the rank processes (rankrun/rank_main.py), not in the test process. The gate is on when the
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

from rankrun.runner import ROOT, SNIPPETS, close_pools


def pytest_addoption(parser):
    group = parser.getgroup("snippet coverage")
    group.addoption("--snippet-coverage", action="store_true", default=None,
                    help="fail the session unless every line in snippets/ ran in some rank")
    group.addoption("--no-snippet-coverage", action="store_false", dest="snippet_coverage",
                    help="do not measure snippet coverage")


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
    if not gate_is_on(config):
        return
    config.snippet_coverage_dir = tempfile.mkdtemp(prefix="snippet-coverage-")
    # Rank processes inherit this and measure themselves (rankrun/rank_main.py).
    os.environ["SNIPPET_COVERAGE_DATA"] = os.path.join(config.snippet_coverage_dir, ".coverage")


# Examples whose lines the gate cannot see whole yet, each with why (said in the summary too).
NOT_MEASURED = {
    "snippets/zero3/check_shared_reads.py": "the checker also runs inside the test process and as a "
                                            "command in a subprocess, neither of which the gate measures",
}


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
        if str(snippet.relative_to(ROOT)) in NOT_MEASURED:
            continue
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
        terminalreporter.write_line("snippet coverage: 100% of the lines in snippets/ ran in some rank"
                                    + "".join(f"; not measured: {path} ({why})" for path, why in NOT_MEASURED.items()))
        return
    terminalreporter.write_sep("=", "snippet coverage gate failed", red=True)
    for path, lines in missing.items():
        terminalreporter.write_line(f"{path}: lines never run in any rank: {', '.join(map(str, lines))}")
