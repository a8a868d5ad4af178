"""The sample of generated models: the checker's verdict (one rank) equals the outcome of a
real ZeRO-3 run compared with plain PyTorch, on 2 and on 4 ranks. The full set runs in
benchmarks/check_shared_reads_generated.py, which this test shares its comparison with."""

import json
import runpy

import pytest

from rankrun.pages import output_file
from rankrun.runner import ROOT, run_snippet

SNIPPET = "snippets/zero3/generated_models.py"
COMPARE = runpy.run_path(str(ROOT / "benchmarks/check_shared_reads_generated.py"))
WRITABLE = runpy.run_path(str(ROOT / "benchmarks/check_shared_reads_architectures.py"))
# Models of the sample where the checker may disagree with the runs: none.
KNOWN = set()
# Generated models (of the 300 the benchmark runs) where the checker's gathering once could
# not keep the step going: ZeRO-3's F.linear stand-in took the shape of the weight before
# the checker gathered it (40, 66), or ZeRO-3 partitioned the gathered weight again before
# autograd accumulated its gradient (the others: read before the owner's forward).
KEPT_GOING = "40,66,125,148,149,169,181,279"


@pytest.fixture(scope="module")
def verdicts():
    return run_snippet(SNIPPET, 1, call="checker_verdicts", timeout=600).check().returned(0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_checker_agrees_with_real_runs(world_size, verdicts, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=600).check()
    runs = [result.returned(rank) for rank in range(world_size)]
    outcomes = {i: COMPARE["real_outcome"]([r[i] for r in runs]) for i in runs[0]}
    assert "works" in outcomes.values() and any(o.startswith("fails") for o in outcomes.values())
    disagree = {i for i, outcome in outcomes.items()
                if not COMPARE["agrees"](outcome, COMPARE["checker_verdict"](verdicts[i][1]))}
    assert disagree <= KNOWN, {i: (outcomes[i], verdicts[i]) for i in disagree}
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


FORWARD = {"parameter": "block.owner.weight", "reader": "block", "phase": "forward", "step": 0,
           "fix": "deepspeed.zero.register_external_parameter(self, self.owner.weight)",
           "where": "at the end of `Block.__init__`", "kind": "use"}


@pytest.fixture(scope="module")
def kept_going():
    env = {"GENERATED_MODELS": KEPT_GOING}
    return run_snippet(SNIPPET, 1, call="checker_verdicts", env=env, timeout=600).check().returned(0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_checker_goes_on_after_gathering(world_size, kept_going):
    """Each of these fails in its real run; the checker names the weight, with nothing
    else (no error of its own run): it trained every step."""
    env = {"GENERATED_MODELS": KEPT_GOING}
    result = run_snippet(SNIPPET, world_size, call="main", env=env, timeout=600).check()
    runs = [result.returned(rank) for rank in range(world_size)]
    for index in map(int, KEPT_GOING.split(",")):
        outcome = COMPARE["real_outcome"]([r[index] for r in runs])
        assert outcome.startswith("fails"), (index, outcome)
        # Model 125 reads it again in backward: its checkpointed forward runs again there.
        want = [FORWARD] + ([{**FORWARD, "phase": "backward"}] if index == 125 else [])
        assert kept_going[index][1] == want, (index, kept_going[index])


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_checkers_fixes_mend_every_flagged_model(world_size, verdicts):
    """Every model of the sample the checker flags, trained again with the fixes it
    proposed applied as it states them (each line at the end of the `__init__` it names):
    every loss and full gradient equals plain PyTorch's."""
    fixes = {str(i): findings for i, (_, findings) in verdicts.items() if findings}
    assert len(fixes) >= 5
    for index, findings in fixes.items():
        WRITABLE["assert_user_can_write"](findings, index)
    env = {"GENERATED_FIXES": json.dumps(fixes)}
    result = run_snippet(SNIPPET, world_size, call="main", env=env, timeout=600).check()
    runs = [result.returned(rank) for rank in range(world_size)]
    assert sorted(runs[0]) == sorted(map(int, fixes))
    for index in runs[0]:
        assert COMPARE["real_outcome"]([r[index] for r in runs]) == "works", (
            index, fixes[str(index)])
