"""The pytest plugin of the harness (registered through the `pytest11` entry point in
pyproject.toml, so every pytest run in the project has it, from any directory).

- `expect_output(result, output_file)`: compare a run's transcript with an output file, or
  rewrite it under `--update-outputs`; a mismatch names the pages that include the file. A run
  that failed rewrites it only for an example documented as failing (see documented_failure).
- `--changed`: only the tests the working tree's change can affect (rankrun.changed).
- `--order declared|reverse|random[:SEED]`: run the tests in another order, to show that runs
  are independent.
- One temporary directory per test session (TMPDIR), removed when the session ends; the
  next session removes those of sessions that were killed.
- One run per distinct example run in the session (rankrun.run_cache, in that directory), and
  a summary line of the runs made.
- The warm zygotes end with the session.
- `@pytest.mark.kernel_independent(reason)`: a test whose outcome does not depend on PyTorch's
  CPU kernels (a refusal, a hang, a message, a check of files). `.ci/run`'s second pass under
  `ATEN_CPU_CAPABILITY=default` leaves these out (`-m "not kernel_independent"`), and the summary
  lists each with its reason. So that the mark stays true, such a test fails when it compares
  numbers: calls the tolerance policy (rankrun.tolerance), or compares an output that holds a
  decimal number with `expect_output`.
"""

from __future__ import annotations

import difflib
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import psutil
import pytest

from rankrun import changed, run_cache, shards
from rankrun.pages import include_specs, output_blocks, page_lines, pages_including
from rankrun.runner import ROOT, RunResult, close_zygotes


def pytest_addoption(parser):
    parser.addoption(
        "--update-outputs",
        action="store_true",
        help="rewrite the output files (snippets/**/*.out) from this run instead of comparing",
    )
    parser.addoption(
        "--changed",
        action="store_true",
        help="run only the tests that the change in the working tree (against HEAD) can affect "
             "(rankrun.changed); CI runs everything",
    )
    parser.addoption("--changed-base", default="HEAD", help="with --changed: compare with this revision")
    parser.addoption(
        "--order",
        default="declared",
        help="test order: declared, reverse, or random[:SEED] (proves runs are independent)",
    )


# Every temporary file of a test session (rank logs, coverage data, site builds, what the
# snippets, torchrun and the notebook write to the temporary directory) goes into one
# directory per session, removed when the session ends. A session that was killed outright
# cannot clean up: the next session removes the directories of sessions that are gone.
SESSION_TMP_PREFIX = "snippet-tests-"


def remove_directories_of_ended_sessions(base: Path) -> None:
    for directory in base.glob(f"{SESSION_TMP_PREFIX}*"):
        pid = directory.name[len(SESSION_TMP_PREFIX):]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line(
        "markers", "runs(*snippets): the examples a check of the machinery runs (real torchrun, say): "
                   "--changed selects it when one of them changes (rankrun.changed)")
    config.addinivalue_line(
        "markers", f"{KERNEL_INDEPENDENT}(reason): the test's outcome does not depend on PyTorch's CPU kernels "
                   "(a refusal, a hang, a message, a check of files); .ci/run's second pass under "
                   "ATEN_CPU_CAPABILITY=default leaves it out and lists it; the harness fails it if it compares numbers")
    if not hasattr(config, "workerinput"):  # pytest-xdist workers inherit TMPDIR
        base = Path(tempfile.gettempdir())
        remove_directories_of_ended_sessions(base)
        config.session_tmp = base / f"{SESSION_TMP_PREFIX}{os.getpid()}"
        config.session_tmp.mkdir(exist_ok=True)
        os.environ["TMPDIR"] = str(config.session_tmp)
        tempfile.tempdir = None  # tempfile caches the directory it found first
        # One run per distinct example run, shared by the tests and the xdist workers.
        os.environ[run_cache.ENVIRONMENT_VARIABLE] = str(config.session_tmp / "runs")
    order = config.getoption("--order")
    name, _, seed = order.partition(":")
    if order not in ("declared", "reverse") and name != "random":
        raise pytest.UsageError(f"--order takes declared, reverse or random[:SEED], not {order!r}")
    if name == "random" and not seed:
        # Chosen once: pytest-xdist workers start after this and inherit it, and must all
        # collect the tests in the same order.
        seed = os.environ.setdefault("TEST_ORDER_SEED", str(random.randrange(10**6)))
    config.order_seed = int(seed) if name == "random" else None


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "session_tmp"):
        line = run_cache.summary(config.session_tmp / "runs")
        if line:
            terminalreporter.write_line(line)
        left_out = left_out_as_kernel_independent(config.session_tmp)
        if left_out:
            terminalreporter.write_line(
                f"left out as kernel_independent (-m {config.getoption('markexpr')!r}): "
                f"{sum(map(len, left_out.values()))} tests "
                f"whose outcome does not depend on the CPU kernels:")
            for reason, nodeids in left_out.items():
                terminalreporter.write_line(f"  {reason}: {len(nodeids)}: " + ", ".join(nodeids))



# A path to keep the session's request log at (rankrun.run_cache), for benchmarks/suite_floor.py.
KEEP_RUN_LOG = "RANKRUN_KEEP_RUN_LOG"


def pytest_unconfigure(config):
    if hasattr(config, "session_tmp"):
        kept = os.environ.get(KEEP_RUN_LOG)
        if kept and (config.session_tmp / "runs" / "requests.jsonl").exists():
            shutil.copyfile(config.session_tmp / "runs" / "requests.jsonl", kept)
        close_zygotes()  # their logs are in it
        shutil.rmtree(config.session_tmp, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if config.getoption("--changed"):
        select_what_the_change_affects(config, items)
        warm_only_what_the_selection_runs(items)
    if config.getoption("--order") == "reverse":
        items.reverse()
    elif config.order_seed is not None:
        random.Random(config.order_seed).shuffle(items)


def outputs_shown(page: str) -> list[str]:
    """The output files (snippets/...out, from the repository root) in a page's output blocks."""
    path = ROOT / page
    if not path.is_file():  # a deleted page
        return []
    return [str(output.resolve().relative_to(ROOT)) for _, _, outputs in output_blocks(page_lines(path))
            for _, output in outputs]


def what_the_change_affects(config) -> changed.Affected:
    """rankrun.changed.affected for this session's change (worked out once per process)."""
    if not hasattr(config, "changed_affected"):
        config.changed_files = changed.changed_files(ROOT, config.getoption("--changed-base"))
        config.changed_affected = changed.affected(config.changed_files, pages_including, outputs_shown)
    return config.changed_affected


def examples_run_by(item) -> tuple[str, ...]:
    """The examples a check of the machinery names with `@pytest.mark.runs("snippets/...py", ...)`."""
    return tuple(arg for marker in item.iter_markers("runs") for arg in marker.args)


def pytest_ignore_collect(collection_path, config):
    """Under --changed, a test module none of whose tests the change can select is not collected."""
    if not config.getoption("--changed") or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_") or not collection_path.is_relative_to(ROOT):
        return None
    if what_the_change_affects(config).may_select_file(str(collection_path.relative_to(ROOT))):
        return None
    return True


def select_what_the_change_affects(config, items) -> None:
    what = what_the_change_affects(config)
    keep = [item for item in items if what.selects(item.nodeid, slow=item.get_closest_marker("slow") is not None,
                                                     runs=examples_run_by(item))]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def examples_of(item) -> set[Path]:
    """The examples a test item runs, as far as its name says: its module's mirror snippet
    (tests/<topic>/test_<name>.py), the snippet in its id (tests/test_snippets.py)."""
    path, _, rest = item.nodeid.partition("::")
    found = set(re.findall(r"\[(snippets/[\w/.-]+\.py)\]", rest))
    parts = Path(path).parts
    if len(parts) >= 3 and parts[0] == "tests" and parts[-1].startswith("test_"):
        found.add(str(Path("snippets", *parts[1:-1], parts[-1].removeprefix("test_"))))
    return {ROOT / name for name in found if (ROOT / name).is_file()}


def warm_only_what_the_selection_runs(items) -> None:
    """Under --changed: when no selected test runs an example that imports Transformers, the warm
    zygote of this process leaves Transformers out of its imports (speed only: a rank that needs
    it imports it, as a fresh process does). Chosen before the zygote starts, with the first run."""
    from rankrun import rank_main

    if os.environ.get("RANKRUN_WARM_IMPORTS"):
        return
    examples = set().union(*(examples_of(item) for item in items)) if items else set()
    if any(re.search(r"^\s*(?:import|from)\s+(?:transformers|accelerate|peft|trl)\b", path.read_text(), re.M)
           for path in examples):
        return
    base = [name for name in rank_main.WARM_IMPORTS if name not in rank_main.TRANSFORMERS_IMPORTS]
    os.environ["RANKRUN_WARM_IMPORTS"] = ",".join(base)


def pytest_report_header(config):
    seed = config.order_seed
    lines = [f"test order: {config.getoption('--order')}"
             + (f" (seed {seed}; repeat with --order random:{seed})" if seed is not None else "")]
    if config.getoption("--changed"):
        files = changed.changed_files(ROOT, config.getoption("--changed-base"))
        lines.append(f"--changed: {len(files)} changed files: " + (", ".join(files[:8]) or "none")
                     + (" ..." if len(files) > 8 else ""))
    return lines


def output_mismatch(name: str, output_file: Path, expected: str, actual: str) -> str:
    """The report for a run that printed something else than its output file: where the file is
    shown, the whole difference, and how to accept the new output."""
    shown = output_file.relative_to(ROOT)
    pages = pages_including(output_file)
    diff = difflib.unified_diff(expected.splitlines(keepends=True), actual.splitlines(keepends=True),
                                fromfile=f"{shown} (committed)", tofile=f"{shown} (this run)")
    return (
        f"{name} printed something else than {shown}, which "
        + (f"is shown on {', '.join(pages)}" if pages else "no page includes")
        + ".\n" + "".join(diff)
        + "\nIf the new output is right (the example changed on purpose), regenerate the output files from "
          "real runs and review the diff:\n    python3 tasks.py test --update-outputs && git diff snippets/"
    )


# How a page introduces the output block of an example meant to fail (docs/testing.md,
# "Output blocks"; tests/test_output_blocks.py checks every block says it).
FAILING_BLOCK_LABEL = "then the exception the ranks raised"
# A line the runner adds to a transcript (RunResult.errors): `Type: message`, or how a rank ended.
RUNNER_LINE = re.compile(r"^(?:(\w+(?:Error|Exception|Interrupt)): |rank \d+ (?:exited with code|killed by signal) )", re.M)


def documented_failure(output_file: Path) -> str | None:
    """Where the example of `output_file` is documented as failing, or None: a page that includes
    the file introduces its block as "…, then the exception the ranks raised", or (for a file no
    page includes) the committed file already ends in the exception."""
    shown = str(output_file.relative_to(ROOT))
    for page in pages_including(output_file):
        lines = (ROOT / page).read_text().splitlines()
        for index, spec in include_specs(lines):
            if spec != shown:
                continue
            before = index - 1
            while before >= 0 and (not lines[before].strip() or lines[before].lstrip().startswith(("```", "~~~"))):
                before -= 1
            paragraph = []
            while before >= 0 and lines[before].strip():
                paragraph.insert(0, lines[before].strip())
                before -= 1
            if FAILING_BLOCK_LABEL in " ".join(paragraph):
                return page
    if output_file.exists() and RUNNER_LINE.search(output_file.read_text()):
        return shown
    return None


def refuse_update(result: RunResult, output_file: Path) -> str | None:
    """Why `--update-outputs` must not record this run's transcript in `output_file`, or None."""
    shown = output_file.relative_to(ROOT)
    if result.ok:
        return None
    left = f"{shown} was left as it is, and the run failed:\n{result.failure_report()}\n"
    if result.timed_out:
        return f"{result.name} timed out under --update-outputs; " + left
    where = documented_failure(output_file)
    if where is None:
        return (
            f"{result.name} failed under --update-outputs, and it is not documented as an example meant "
            f"to fail (no page that includes {shown} introduces it as \"..., {FAILING_BLOCK_LABEL}\"), so "
            + left + "Fix the example. If it is meant to fail, say so on its page (docs/testing.md, "
            "\"Output blocks\") and run --update-outputs again."
        )
    committed = output_file.read_text() if output_file.exists() else ""
    shown_types = {match for match in RUNNER_LINE.findall(committed) if match}
    raised_types = {match for match in RUNNER_LINE.findall(result.transcript()) if match}
    if shown_types and shown_types != raised_types:
        return (
            f"{result.name} is documented as failing with {', '.join(sorted(shown_types))} ({shown}), but this "
            f"run ended with {', '.join(sorted(raised_types)) or 'no exception'}; "
            + left + f"If the new failure is the one its page should show, remove {shown} and run "
            "--update-outputs again."
        )
    return None


@pytest.fixture
def expect_output(request):
    """Compare a run's transcript with an output file, or rewrite it under --update-outputs
    (a failed run only for an example documented as failing, with the exception it shows)."""
    update = request.config.getoption("--update-outputs")

    independent = kernel_independent_reason(request.node)

    def check(result: RunResult, output_file: Path) -> None:
        actual = result.transcript()
        if independent is not None and DECIMAL.search(actual):
            pytest.fail(f"{request.node.nodeid} is marked kernel_independent ({independent}), but the output it "
                        f"compares holds decimal numbers, which the CPU kernels can change: "
                        f"{DECIMAL.search(actual).group(0)!r} in {output_file.name}. Remove the mark.", pytrace=False)
        if update:
            refused = refuse_update(result, output_file)
            if refused:
                pytest.fail(refused, pytrace=False)
            output_file.write_text(actual)
            return
        if not output_file.exists():
            pytest.fail(
                f"{output_file.relative_to(ROOT)} is missing; create it from a real run with "
                f"`python3 tasks.py test --update-outputs`"
            )
        expected = output_file.read_text()
        if actual != expected:
            context = "" if result.ok else "\n" + result.failure_report()
            pytest.fail(output_mismatch(result.name, output_file, expected, actual) + context, pytrace=False)

    return check


# --- kernel_independent -----------------------------------------------------------------------

KERNEL_INDEPENDENT = "kernel_independent"
LEFT_OUT_LOG = "kernel-independent-left-out.jsonl"
# A decimal number in a transcript (printed losses, norms, sums: what a kernel change can move),
# not a dotted version such as 5.24.0.
DECIMAL = re.compile(r"(?<![\d.])\d+\.\d+(?![\d.])")


def kernel_independent_reason(item) -> str | None:
    marker = item.get_closest_marker(KERNEL_INDEPENDENT)
    if marker is None:
        return None
    reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
    if not reason:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.kernel_independent needs a reason")
    return reason


def pytest_deselected(items):
    """Log the kernel-independent tests a marker expression left out (in the session's directory,
    shared by the xdist workers; the main process lists them in its summary)."""
    directory = os.environ.get(run_cache.ENVIRONMENT_VARIABLE)
    left_out = [(item.nodeid, kernel_independent_reason(item)) for item in items
                if item.get_closest_marker(KERNEL_INDEPENDENT) and item_deselected_by_marks(item)]
    if not directory or not left_out:
        return
    log = Path(directory).parent / LEFT_OUT_LOG
    with open(log, "a") as handle:
        for nodeid, reason in left_out:
            handle.write(json.dumps({"nodeid": nodeid, "reason": reason}) + "\n")


def item_deselected_by_marks(item) -> bool:
    """Whether `-m` deselected the item (not -k, --changed or the coverage gate)."""
    from _pytest.mark import MarkMatcher
    from _pytest.mark.expression import Expression

    expression = item.config.getoption("markexpr")
    return bool(expression) and not Expression.compile(expression).evaluate(MarkMatcher.from_markers(item.iter_markers()))


def left_out_as_kernel_independent(session_tmp: Path) -> dict[str, list[str]]:
    """reason -> the node ids left out, from the log the workers wrote."""
    log = session_tmp / LEFT_OUT_LOG
    grouped: dict[str, list[str]] = {}
    if log.exists():
        for entry in sorted({line for line in log.read_text().splitlines() if line}):
            entry = json.loads(entry)
            grouped.setdefault(entry["reason"], []).append(entry["nodeid"])
    return grouped


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """While a kernel-independent test runs, comparing numbers fails it (rankrun.tolerance)."""
    reason = kernel_independent_reason(item)
    if reason is None:
        yield
        return
    from rankrun import tolerance

    tolerance.forbidden_because = f"{item.nodeid} is marked kernel_independent ({reason})"
    try:
        yield
    finally:
        tolerance.forbidden_because = None


# --- pytest-xdist: an example's tests on one worker -------------------------------------------

# Items of these modules that name an example (in their id) run in the same worker as the
# example's own test module, when that module is collected too: the run they share is made in
# that worker, the other workers neither wait for it nor start a warm zygote for it. The shards
# (rankrun.shards) keep the same items together.
GROUPED_WITH_THE_EXAMPLE = shards.GROUPED_WITH_THE_EXAMPLE
EXAMPLE_IN_AN_ID = shards.EXAMPLE_IN_AN_ID


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (what tasks.py passes): files stay on one worker, as before, and each
    example's items of GROUPED_WITH_THE_EXAMPLE go with the example's test module."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ExampleScheduling(LoadFileScheduling):
        files: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            match = EXAMPLE_IN_AN_ID.search(nodeid) if path in GROUPED_WITH_THE_EXAMPLE else None
            if match is None:
                return path
            if self.files is None:
                self.files = {other.split("::", 1)[0] for other in self.collection or ()}
            mirror = changed.mirror_test(match.group(1))
            return mirror if mirror in self.files else path

    return ExampleScheduling(config, log)
