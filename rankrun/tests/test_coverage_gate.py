"""The snippet-coverage gate (rankrun/coverage_gate.py, rankrun.snippet_coverage) measures each
example only in the runs that can still add a line, and still fails on a line that no rank of any
run reached, and only on such a line: lines only rank 1 runs, only a 4-rank run runs, only a middle
rank of a 4-rank run runs, only a failing run reaches, or only an imported module runs on rank 1
all pass; the runs after every line of their files was seen are not traced."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a pytest session of its own, checking the harness

HELPER = '''
def double(x):
    return 2 * x
'''

EVERYWHERE = '''
"""DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/demo/everywhere.py"""
import torch
import torch.distributed as dist

from helper import double


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        print("only rank 1:", double(rank))
    if dist.get_world_size() == 4:
        print("only on four ranks")
    if 0 < rank < dist.get_world_size() - 1:
        print("a middle rank")
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return float(total)


if __name__ == "__main__":
    main()
'''

PLAIN = '''
import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return float(total)


if __name__ == "__main__":
    main()
'''

FAILING = '''
import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here until the runner kills it
    print("never")  # never reached: rank 1 raised


if __name__ == "__main__":
    main()
'''

DEAD = '''
def never_called():
    return "dead"


def main():
    return "alive"


if __name__ == "__main__":
    main()
'''

TESTS = '''
from rankrun import run_snippet


def test_everywhere_on_two_ranks():
    assert run_snippet("snippets/demo/everywhere.py", 2).check().returned(0) == 2.0


def test_everywhere_on_four_ranks_with_another_environment():
    run_snippet("snippets/demo/everywhere.py", 4, env={"ANOTHER": "1"}).check()


def test_everywhere_on_four_ranks():
    assert run_snippet("snippets/demo/everywhere.py", 4).check().returned(0) == 4.0


def test_plain_three_times():
    run_snippet("snippets/demo/plain.py", 2).check()
    run_snippet("snippets/demo/plain.py", 4).check()
    run_snippet("snippets/demo/plain.py", 2, env={"ANOTHER": "1"}).check()


def test_failing():
    result = run_snippet("snippets/demo/failing.py", 2, grace=1.0)
    assert result.ranks[1].exception["message"] == "rank 1 gave up"


def test_dead():
    run_snippet("snippets/demo/dead.py", 1).check()
'''


def demo_project(tmp_path):
    (tmp_path / "mkdocs.yml").write_text("site_name: demo\n")
    demo = tmp_path / "snippets" / "demo"
    demo.mkdir(parents=True)
    for name, text in {"helper": HELPER, "everywhere": EVERYWHERE, "plain": PLAIN, "failing": FAILING,
                       "dead": DEAD}.items():
        (demo / f"{name}.py").write_text(textwrap.dedent(text).lstrip())
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_demo.py").write_text(TESTS)
    return {**os.environ, "RANKRUN_PROJECT": str(tmp_path), "RANKRUN_WARM_IMPORTS": "torch"}


def session(tmp_path, env, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", *args,
                           "tests/test_demo.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


MISSING = re.compile(r"^(snippets/\S+): lines never run in any rank: (.*)$", re.M)


def test_the_gate_fails_on_a_dead_line_only_and_traces_only_what_can_add_a_line(tmp_path):
    env = demo_project(tmp_path)
    done = session(tmp_path, env, "--snippet-coverage")
    report = done.stdout + done.stderr
    assert done.returncode == 1, report
    assert "6 passed" in report, report
    missing = MISSING.findall(report)
    # dead.py's line 2 (the body of never_called) and nothing else: every other line ran in some rank
    assert missing == [("snippets/demo/dead.py", "2")], report
    # 8 runs. Traced: everywhere on 2 ranks, then on 4 with another environment (its 4-rank and
    # middle-rank lines still unseen), plain's first run, failing, dead.py's (its dead line is never
    # seen). Not traced: everywhere on 4 ranks, plain's second and third: every line already seen.
    assert ("snippet coverage: measured in 5 of 8 runs; 3 not traced: every line of their files already "
            "seen") in report, report


def test_parts_of_the_suite_are_judged_on_their_union(tmp_path):
    """The hosted CI's shards: each part traces every rank of a run that can add a line and keeps
    what it saw (--snippet-coverage-data); the verdict on the union is the whole suite's."""
    env = demo_project(tmp_path)
    for part, chosen in (("one", "two_ranks or plain or dead"), ("two", "not (two_ranks or plain or dead)")):
        done = session(tmp_path, env, "--snippet-coverage-data", str(tmp_path / part), "-k", chosen)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"snippet coverage: lines seen kept in {tmp_path / part}" in done.stdout, done.stdout

    def verdict(*parts):
        return subprocess.run([sys.executable, "-m", "rankrun.snippet_coverage", *map(str, parts)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)

    union = verdict(tmp_path / "one", tmp_path / "two")
    assert union.returncode == 1 and MISSING.findall(union.stdout) == [("snippets/demo/dead.py", "2")], union.stdout
    # part one alone: the 4-rank lines and failing.py (part two's runs) are missing; the line only
    # rank 1 runs (and helper.py's, called there) is not: every rank of that run was traced
    alone = verdict(tmp_path / "one")
    assert dict(MISSING.findall(alone.stdout)) == {
        "snippets/demo/dead.py": "2", "snippets/demo/everywhere.py": "14, 16",
        "snippets/demo/failing.py": "1, 2, 5, 6, 7, 8, 9, 13, 14",
    }, alone.stdout
