"""The suite in shards (rankrun.shards, `--shard K/N`): every test of the suite is in exactly one
shard, a test with no recorded duration still lands in one, the tests that share runs stay in one,
and with the committed durations the slowest of 4 shards is predicted at most 35% of the suite."""

import re
import subprocess
import sys

import pytest

from rankrun import selection, shards
from rankrun.runner import ROOT

pytestmark = pytest.mark.slow  # collects the whole suite, and pytest sessions of their own


@pytest.fixture(scope="module")
def the_suite(request) -> list[str]:
    """Every node id of the whole suite, as `python3 tasks.py test` collects it: what this session
    collected when it collected the whole suite (rankrun.selection.COLLECTED), else a collection of
    its own."""
    if request.config.stash.get(selection.COLLECTED_WHOLE_SUITE, False):
        return request.config.stash[selection.COLLECTED]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


@pytest.mark.parametrize("count", [2, 4, 7])
def test_every_test_of_the_suite_is_in_exactly_one_shard(the_suite, count):
    chosen = shards.assign(the_suite, count, shards.read_durations())
    assert sorted(nodeid for shard in chosen for nodeid in shard) == sorted(the_suite)
    assert all(chosen), "a shard without a test"


def test_a_test_without_a_recorded_duration_lands_in_a_shard(the_suite):
    added = "tests/zero3/test_an_example_added_since.py::test_it_compares_with_one_process[2]"
    durations = shards.read_durations()
    assert added not in durations
    chosen = shards.assign([*the_suite, added], 4, durations)
    assert sum(shard.count(added) for shard in chosen) == 1


def test_the_tests_that_share_an_examples_runs_stay_in_one_shard(the_suite):
    chosen = shards.assign(the_suite, 4, shards.read_durations())
    shard_of = {nodeid: index for index, shard in enumerate(chosen) for nodeid in shard}
    example = "snippets/zero3/language_model.py"
    sharing = [nodeid for nodeid in the_suite
               if nodeid.startswith("tests/zero3/test_language_model.py::")
               or (nodeid.startswith(shards.GROUPED_WITH_THE_EXAMPLE) and f"[{example}]" in nodeid)]
    assert len(sharing) > 3
    assert len({shard_of[nodeid] for nodeid in sharing}) == 1


def test_with_the_recorded_durations_the_slowest_of_four_shards_is_at_most_35_percent(the_suite):
    durations = shards.read_durations()
    recorded = [nodeid for nodeid in the_suite if nodeid in durations]
    assert len(recorded) >= 0.9 * len(the_suite), (
        f"{len(the_suite) - len(recorded)} tests have no recorded duration; record them: "
        "python3 tasks.py test --store-durations")
    predicted = shards.predicted(the_suite, 4, durations)
    assert max(predicted) <= 0.35 * sum(predicted), predicted


TESTS = '''
import pytest


@pytest.mark.parametrize("n", range(5))
def test_a(n):
    pass


def test_b():
    pass
'''


def test_the_durations_are_stored_and_the_shard_option_runs_the_assigned_tests(tmp_path):
    (tmp_path / "mkdocs.yml").write_text("site_name: demo\n")
    (tmp_path / "tests").mkdir()
    for name in ("one", "two", "three"):
        (tmp_path / "tests" / f"test_{name}.py").write_text(TESTS)
    stored = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                             "--store-durations", "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "RANKRUN_PROJECT": str(tmp_path)})
    assert stored.returncode == 0, stored.stdout + stored.stderr
    recorded = shards.read_durations(tmp_path / "tests" / "durations.json")
    assert len(recorded) == 18 and "tests/test_two.py::test_a[3]" in recorded, recorded
    collected = {}
    for shard in (1, 2, 3):
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                               "--collect-only", "--shard", f"{shard}/3", "tests"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**__import__("os").environ, "RANKRUN_PROJECT": str(tmp_path)})
        assert done.returncode == 0, done.stdout + done.stderr
        collected[shard] = [line for line in done.stdout.splitlines() if "::" in line]
        assert re.search(rf"^{len(collected[shard])}/18 tests collected \({18 - len(collected[shard])} deselected\)",
                         done.stdout, re.M), done.stdout
    every = [nodeid for shard in collected.values() for nodeid in shard]
    assert len(every) == len(set(every)) == 18
    # each file is a group (its tests share module fixtures), of about equal weight: one per shard
    assert all(len({nodeid.split("::")[0] for nodeid in shard}) == 1 for shard in collected.values()), collected
    bad = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--shard", "4/3"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "RANKRUN_PROJECT": str(tmp_path)})
    assert bad.returncode == 4 and "--shard 4/3: K must be between 1 and N" in bad.stderr, bad.stderr
