"""`@pytest.mark.kernel_independent(reason)` (rankrun.plugin, rankrun.marks): a marked test that
compares numbers fails, so the mark cannot hide a comparison from the second-kernel pass; a
marker expression that leaves marked tests out lists each with its reason; `--smallest-rank-count`
(the same pass) keeps, of a test parametrized by world_size, the smallest rank count for each of
its other parameters, and lists what it left out with the test it kept."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a pytest session of its own, checking the harness

CASES = '''
import pytest
from pathlib import Path
from rankrun.tolerance import assert_matches


class Printed:
    ok = True
    name = "made-up"

    def __init__(self, text):
        self.text = text

    def transcript(self):
        return self.text


@pytest.mark.kernel_independent(reason="made up: compares a tensor")
def test_compares_with_the_tolerance_policy():
    assert_matches(1.0, 1.0)


@pytest.mark.kernel_independent(reason="made up: an output with a loss")
def test_compares_an_output_holding_a_decimal(expect_output, tmp_path):
    (tmp_path / "x.out").write_text("step 0: loss 2.5000\\n")
    expect_output(Printed("step 0: loss 2.5000\\n"), tmp_path / "x.out")


@pytest.mark.kernel_independent(reason="made up: a message and a version")
def test_compares_a_message(expect_output, tmp_path):
    (tmp_path / "x.out").write_text("transformers 5.24.0\\nValueError: 8 samples do not split over 3 ranks\\n")
    expect_output(Printed("transformers 5.24.0\\nValueError: 8 samples do not split over 3 ranks\\n"), tmp_path / "x.out")


def test_numbers():
    assert_matches([1.0, 2.0], [1.0, 2.0])


@pytest.mark.parametrize("world_size", [4, 2])
@pytest.mark.parametrize("steps", [1, 3])
def test_at_rank_counts(world_size, steps):
    assert_matches(float(steps), float(steps))
'''


def session(tmp_path, *args):
    (tmp_path / "test_cases.py").write_text(CASES)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                           "test_cases.py", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_a_marked_test_that_compares_numbers_fails(tmp_path):
    done = session(tmp_path)
    assert done.returncode == 1, done.stdout
    assert ("test_cases.py::test_compares_with_the_tolerance_policy is marked kernel_independent (made up: compares "
            "a tensor), but compares numbers with the tolerance policy") in done.stdout
    assert ("test_cases.py::test_compares_an_output_holding_a_decimal is marked kernel_independent (made up: an "
            "output with a loss), but the output it compares holds decimal numbers, which the CPU kernels can "
            "change: '2.5000' in x.out") in done.stdout
    assert "2 failed, 6 passed" in done.stdout, done.stdout


def test_the_second_pass_lists_what_it_left_out(tmp_path):
    """.ci/run's second pass: -m "not kernel_independent" and --smallest-rank-count, in one session."""
    done = session(tmp_path, "-m", "not kernel_independent", "--smallest-rank-count")
    assert done.returncode == 0, done.stdout
    assert "3 passed, 5 deselected" in done.stdout, done.stdout
    assert ("left out as kernel_independent (-m 'not kernel_independent'): 3 tests whose outcome does not depend "
            "on the CPU kernels:") in done.stdout
    assert "  made up: a message and a version: 1: test_cases.py::test_compares_a_message" in done.stdout
    assert ("left out at a larger rank count (--smallest-rank-count): 2 tests whose comparison runs at a smaller "
            "rank count:") in done.stdout
    for steps in (1, 3):
        assert (f"  the same comparison, through the same CPU kernels, runs at a smaller rank count in "
                f"test_cases.py::test_at_rank_counts[{steps}-2]: test_cases.py::test_at_rank_counts[{steps}-4]"
                in done.stdout), done.stdout
