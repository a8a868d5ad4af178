"""The sample of generated models with copies and writes: the checker's verdict (one rank)
equals the outcome of a real ZeRO-3 run compared with plain PyTorch, on 2 and on 4 ranks, and
every flagged model trains like one process with the checker's fixes applied as it states
them. The full set runs in benchmarks/check_shared_reads_generated.py --family copies, which
this test shares its comparison with."""

import json
import runpy

import pytest

from rankrun.pages import output_file
from rankrun.runner import ROOT, run_snippet

SNIPPET = "snippets/zero3/generated_copies.py"
COMPARE = runpy.run_path(str(ROOT / "benchmarks/check_shared_reads_generated.py"))
WRITABLE = runpy.run_path(str(ROOT / "benchmarks/check_shared_reads_architectures.py"))


@pytest.fixture(scope="module")
def verdicts():
    return run_snippet(SNIPPET, 1, call="checker_verdicts", timeout=900).check().returned(0)


def outcomes(result, world_size):
    runs = [result.returned(rank) for rank in range(world_size)]
    return runs, {i: COMPARE["real_outcome"]([r[i] for r in runs]) for i in runs[0]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_checker_agrees_with_real_runs(world_size, verdicts, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=900).check()
    runs, real = outcomes(result, world_size)
    # The sample has models that work, fail and are silently wrong, copies and writes.
    assert "works" in real.values() and "silently wrong" in real.values()
    assert any(o.startswith("fails") for o in real.values())
    kinds = {f["kind"] for _, findings in verdicts.values() for f in findings}
    assert {"copy", "write"} <= kinds, kinds
    for index, outcome in real.items():
        verdict = COMPARE["checker_verdict"](verdicts[index][1])
        affected = runs[0][index]["affected"]
        assert COMPARE["agrees"](outcome, verdict, affected), (index, outcome, verdicts[index])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_checkers_fixes_mend_every_flagged_model(world_size, verdicts):
    fixes = {str(i): findings for i, (_, findings) in verdicts.items() if findings}
    assert len(fixes) >= 5
    for index, findings in fixes.items():
        WRITABLE["assert_user_can_write"](findings, index)
    env = {"GENERATED_FIXES": json.dumps(fixes)}
    result = run_snippet(SNIPPET, world_size, call="main", env=env, timeout=900).check()
    runs, real = outcomes(result, world_size)
    assert sorted(runs[0]) == sorted(map(int, fixes))
    for index, outcome in real.items():
        assert outcome == "works", (index, outcome, fixes[str(index)])
