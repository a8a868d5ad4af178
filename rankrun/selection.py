"""Pytest plugin (the `pytest11` entry point rankrun_selection): which of the collected tests a
session runs, and the durations the suite is split by.

- `--shard K/N`: the K-th of N shards of the selected tests, split by the durations recorded in
  tests/durations.json (rankrun.shards), as one job of the hosted CI's matrix runs it.
- `--store-durations`: record each test's duration (setup, call and teardown) and write them to
  tests/durations.json at the end: the whole suite rewrites the file, a part of it updates it.
- `--smallest-rank-count`: of a test parametrized by world_size, the smallest rank count for each of
  its other parameters (.ci/run's second pass); the summary lists what it left out, each with the
  test kept for it (rankrun.marks.SMALLER_RANK_COUNT).
- What the session collected before any selection (COLLECTED), and whether that was the whole
  suite: rankrun/tests/test_shards.py reads it instead of collecting the suite again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rankrun import marks, run_cache, shards


def pytest_addoption(parser):
    parser.addoption(
        "--shard", default=None, metavar="K/N",
        help="run only the K-th of N shards of the selected tests, split by the recorded durations "
             "(rankrun.shards; tests/durations.json)",
    )
    parser.addoption(
        "--store-durations", action="store_true",
        help="record each test's duration in tests/durations.json at the end of the session "
             "(rewritten after the whole suite, updated after a part of it)",
    )
    parser.addoption(
        "--smallest-rank-count", action="store_true",
        help="of a test parametrized by world_size, run only the smallest rank count (with the same other "
             "parameters); the summary lists what was left out (.ci/run's second pass)",
    )


@pytest.hookimpl(tryfirst=True)  # before the coverage gate's, which is off for a shard
def pytest_configure(config):
    shard = config.getoption("--shard")
    if shard is not None:
        try:
            config.shard = shards.parse_shard(shard)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None


# What this session collected, before any selection (a list of node ids), and whether that was the
# whole suite: rankrun/tests/test_shards.py reads it instead of collecting the suite again.
COLLECTED = pytest.StashKey[list]()
COLLECTED_WHOLE_SUITE = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    from rankrun.coverage_gate import selects_every_test_file

    config.stash[COLLECTED] = [item.nodeid for item in items]
    config.stash[COLLECTED_WHOLE_SUITE] = (
        selects_every_test_file(config) and not config.getoption("ignore") and not config.getoption("ignore_glob")
        and not config.getoption("deselect") and not config.getoption("--changed"))


RANK_COUNT = "world_size"  # the parameter name of a rank count in the example tests
LARGER_RANK_COUNT_LOG = "larger-rank-count-left-out.jsonl"


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_after_marks(config, items):
    """After --changed, -m and -k have selected (trylast): --smallest-rank-count, then --shard."""
    if config.getoption("--smallest-rank-count"):
        keep_the_smallest_rank_count(config, items)
    if getattr(config, "shard", None):
        keep_one_shard(config, items)


def keep_the_smallest_rank_count(config, items) -> None:
    """--smallest-rank-count: of the items of one test function that differ only in world_size, the
    one with the smallest; the others deselected and logged with the one kept (the summary lists them)."""
    def key_of(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if RANK_COUNT not in params:
            return None
        return (str(item.path), item.originalname,
                tuple(sorted((name, repr(value)) for name, value in params.items() if name != RANK_COUNT)))

    smallest: dict[tuple, object] = {}
    for item in items:
        key = key_of(item)
        if key is not None and (key not in smallest
                                or item.callspec.params[RANK_COUNT] < smallest[key].callspec.params[RANK_COUNT]):
            smallest[key] = item
    left = [(item, smallest[key_of(item)]) for item in items
            if key_of(item) is not None and smallest[key_of(item)] is not item]
    if not left:
        return
    directory = os.environ.get(run_cache.ENVIRONMENT_VARIABLE)
    if directory:
        with open(Path(directory).parent / LARGER_RANK_COUNT_LOG, "a") as handle:
            for item, instead in left:
                handle.write(json.dumps({"nodeid": item.nodeid, "kept": instead.nodeid}) + "\n")
    gone = {id(item) for item, _ in left}
    config.hook.pytest_deselected(items=[item for item, _ in left])
    items[:] = [item for item in items if id(item) not in gone]


def left_out_at_a_larger_rank_count(session_tmp: Path) -> dict[str, list[str]]:
    """The test kept -> the node ids left out for it, from the log the workers wrote."""
    log = session_tmp / LARGER_RANK_COUNT_LOG
    grouped: dict[str, list[str]] = {}
    if log.exists():
        for entry in sorted({line for line in log.read_text().splitlines() if line}):
            entry = json.loads(entry)
            grouped.setdefault(entry["kept"], []).append(entry["nodeid"])
    return grouped


def keep_one_shard(config, items) -> None:
    """--shard K/N: the items of the K-th shard (rankrun.shards), in their order; the others deselected."""
    shard, count = config.shard
    chosen = set(shards.assign([item.nodeid for item in items], count, shards.read_durations())[shard - 1])
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in chosen])
    items[:] = [item for item in items if item.nodeid in chosen]


def pytest_runtest_logreport(report):
    """--store-durations: each test's setup, call and teardown, summed (in the main process, which
    gets every pytest-xdist worker's reports)."""
    recorded = _RECORDED_DURATIONS
    if recorded is not None:
        recorded[report.nodeid] = recorded.get(report.nodeid, 0.0) + report.duration


_RECORDED_DURATIONS: dict[str, float] | None = None


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    global _RECORDED_DURATIONS
    config = session.config
    if config.getoption("--store-durations") and not hasattr(config, "workerinput"):
        _RECORDED_DURATIONS = {}


def store_durations(session, exitstatus) -> None:
    """Write what --store-durations recorded: the whole suite's replace the file, a part's update it."""
    from rankrun.coverage_gate import selects_every_test_file

    if _RECORDED_DURATIONS is None or exitstatus not in (0, 1) or not _RECORDED_DURATIONS:
        return
    config = session.config
    whole = (selects_every_test_file(config) and not config.getoption("keyword")
             and not config.getoption("markexpr") and not getattr(config, "shard", None)
             and not config.getoption("--changed"))
    durations = {} if whole else shards.read_durations()
    durations.update(_RECORDED_DURATIONS)
    shards.write_durations(durations)


def pytest_sessionfinish(session, exitstatus):
    store_durations(session, exitstatus)




def pytest_terminal_summary(terminalreporter, config):
    if not hasattr(config, "session_tmp"):  # rankrun.plugin's, in the main process
        return
    larger = left_out_at_a_larger_rank_count(config.session_tmp)
    if larger:
        terminalreporter.write_line(
            f"left out at a larger rank count (--smallest-rank-count): {sum(map(len, larger.values()))} tests "
            f"whose comparison runs at a smaller rank count:")
        for kept, nodeids in larger.items():
            terminalreporter.write_line(f"  {marks.SMALLER_RANK_COUNT.format(kept=kept)}: " + ", ".join(nodeids))
