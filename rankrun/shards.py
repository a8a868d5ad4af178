"""The suite in N shards by recorded durations, for the hosted CI's matrix (`--shard K/N`).

    python3 tasks.py test --shard 2/4          # the second of four shards, as one CI job runs it
    python3 tasks.py test --store-durations    # the whole suite, then DURATIONS rewritten from it

Tests go to shards in groups that must stay together, because they share what they cost:

- the tests of one file (module fixtures, e.g. the site build of tests/test_site.py);
- an example's items of tests/test_snippets.py and tests/test_versions.py go with the example's own
  test module (tests/<topic>/test_<name>.py), or, when it has none, form a group of their own: they
  read the same runs (rankrun.run_cache), which a shard makes once. A run that tests of two shards
  read is made in both; the groups keep that rare.

A group weighs the sum of its tests' recorded durations (setup, call and teardown, from a whole
session); a test with no recorded duration (one added since) weighs the mean recorded duration,
so it still lands in some shard. The heaviest group goes first, each to the shard with the least
weight so far (ties: the lower shard number), and every pytest-xdist worker computes the same
assignment from the same node ids. The durations file has pytest-split's format (node id ->
seconds), so that tool can read it; pytest-split itself splits single tests, which would split
these groups.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from rankrun import changed
from rankrun.project import ROOT

DURATIONS = ROOT / "tests" / "durations.json"
# Items of these modules that name an example (in their id) go with the example's runs.
GROUPED_WITH_THE_EXAMPLE = ("tests/test_snippets.py", "tests/test_versions.py")
EXAMPLE_IN_AN_ID = re.compile(r"\[(?:torchrun --nproc_per_node \d+ )?(snippets/[\w/.-]+\.py)\]")
SHARD = re.compile(r"^(\d+)/(\d+)$")


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), 1 <= K <= N; ValueError with what is wrong otherwise."""
    match = SHARD.match(text.strip())
    if not match:
        raise ValueError(f"--shard takes K/N (the K-th of N shards, e.g. 2/4), not {text!r}")
    shard, shards = int(match.group(1)), int(match.group(2))
    if not 1 <= shard <= shards:
        raise ValueError(f"--shard {text}: K must be between 1 and N")
    return shard, shards


def group_of(nodeid: str, files: set[str]) -> str:
    """The group a test goes with (see the module docstring); `files`: the collected test files."""
    path = nodeid.split("::", 1)[0]
    match = EXAMPLE_IN_AN_ID.search(nodeid) if path in GROUPED_WITH_THE_EXAMPLE else None
    if match is None:
        return path
    mirror = changed.mirror_test(match.group(1))
    return mirror if mirror in files else match.group(1)


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


# The least a test weighs: its setup and teardown cost something even where the recorded duration
# rounds to 0, and groups of no weight would all go to the first shard.
LEAST = 0.01


def weights(nodeids: list[str], durations: dict[str, float]) -> dict[str, float]:
    """Each test's weight: its recorded duration, or the mean of those recorded (see above)."""
    known = [durations[nodeid] for nodeid in nodeids if nodeid in durations]
    mean = sum(known) / len(known) if known else 1.0
    return {nodeid: max(durations.get(nodeid, mean), LEAST) for nodeid in nodeids}


def assign(nodeids: Iterable[str], shards: int, durations: dict[str, float]) -> list[list[str]]:
    """The node ids of each shard (index 0 is shard 1/N), each in the order given."""
    nodeids = list(nodeids)
    files = {nodeid.split("::", 1)[0] for nodeid in nodeids}
    weight = weights(nodeids, durations)
    groups: dict[str, list[str]] = defaultdict(list)
    for nodeid in nodeids:
        groups[group_of(nodeid, files)].append(nodeid)
    load = [0.0] * shards
    shard_of_group: dict[str, int] = {}
    # Heaviest first; equal weights in name order, so that the result depends on nothing else.
    for name in sorted(groups, key=lambda name: (-sum(weight[n] for n in groups[name]), name)):
        lightest = min(range(shards), key=lambda index: (load[index], index))
        shard_of_group[name] = lightest
        load[lightest] += sum(weight[nodeid] for nodeid in groups[name])
    chosen: list[list[str]] = [[] for _ in range(shards)]
    for nodeid in nodeids:
        chosen[shard_of_group[group_of(nodeid, files)]].append(nodeid)
    return chosen


def predicted(nodeids: list[str], shards: int, durations: dict[str, float]) -> list[float]:
    """Each shard's predicted time: the sum of its tests' weights."""
    weight = weights(nodeids, durations)
    return [sum(weight[nodeid] for nodeid in shard) for shard in assign(nodeids, shards, durations)]


def write_durations(recorded: dict[str, float], path: Path = DURATIONS) -> None:
    """Rewrite the durations file: node id -> seconds, rounded, sorted (a stable diff)."""
    path.write_text(json.dumps({nodeid: round(seconds, 3) for nodeid, seconds in sorted(recorded.items())},
                               indent=0) + "\n")
