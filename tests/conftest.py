from __future__ import annotations

from pathlib import Path

import pytest

from runner import ROOT, RunResult


def pytest_addoption(parser):
    parser.addoption(
        "--update-outputs",
        action="store_true",
        help="rewrite the output files (snippets/**/*.out) from this run instead of comparing",
    )


@pytest.fixture
def expect_output(request):
    """Compare a run's transcript with an output file, or rewrite it under --update-outputs."""
    update = request.config.getoption("--update-outputs")

    def check(result: RunResult, output_file: Path) -> None:
        actual = result.transcript()
        if update:
            output_file.write_text(actual)
            return
        if not output_file.exists():
            pytest.fail(
                f"{output_file.relative_to(ROOT)} is missing; create it from a real run with "
                f"`python3 tasks.py test --update-outputs`"
            )
        expected = output_file.read_text()
        context = "" if result.ok else "\n" + result.failure_report()
        assert actual == expected, f"{result.name} printed something else than {output_file.relative_to(ROOT)}{context}"

    return check
