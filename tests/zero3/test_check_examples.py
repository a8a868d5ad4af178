"""check_examples.py: the checker on the pages' models and on a tiny Hugging Face GPT-2, one
process; the findings it returns and the output the page shows. Then every example it flags,
trained under ZeRO-3 on 2 ranks as it is and with the checker's fixes applied as it states
them: as it is it fails or differs from one process; fixed, it trains like one process."""

import json
import runpy

import pytest

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import ROOT, run_snippet
from rankrun.tolerance import matches

SNIPPET = "snippets/zero3/check_examples.py"
COMPARE = runpy.run_path(str(ROOT / "benchmarks/check_shared_reads_architectures.py"))


@pytest.fixture(scope="module")
def checked():
    return run_snippet(SNIPPET, 1, call="main", timeout=600).check()


@pytest.fixture(scope="module")
def found(checked):
    return checked.returned(0)


@marks.findings
def test_findings_on_the_pages_examples(checked, found, expect_output):
    for name, findings in found.items():
        COMPARE["assert_user_can_write"](findings, name)
    assert found["language_model"] == []
    assert found["module_z3_without_registration"] == []
    assert [(f["parameter"], f["reader"], f["phase"], f["step"]) for f in
            found["tied_through_a_list"]] == [("embeddings.weight", "(model)", "forward", 0)]
    assert [(f["parameter"], f["reader"], f["phase"]) for f in
            found["loss_reads_the_weight"]] == [("embeddings.weight", "(outside any forward)", "loop")]
    # A module kept out of the module tree: named by the path that reaches it and where it
    # was built, and fixed by making it a submodule (frozen, as the optimizer never had it).
    held = found["held_outside_the_tree"]
    source = (ROOT / SNIPPET).read_text().splitlines()
    built = 1 + next(i for i, line in enumerate(source) if 'self.__dict__["head"] =' in line)
    assert [f["parameter"] for f in held] == [
        f"head.{name} (outside the model's module tree: held by Linear at "
        f"check_examples.py:{built})" for name in ("weight", "bias")]
    assert {(f["phase"], f["fix"], f["where"].split(":")[0]) for f in held} == {(
        "forward", 'self.add_module("head", self.__dict__.pop("head").requires_grad_(False))',
        "at the end of `HeldOutsideTheTree.__init__`")}
    # Transformers' own weight initialisation writes the partitioned weights: constructor
    # findings only, for the weights whose values it changes (not the norms' ones and the
    # zero biases, which keep their values); the fix is from_config.
    gpt2 = found["tiny_gpt2"]
    assert gpt2 and {f["phase"] for f in gpt2} == {"constructor"}
    assert "transformer.wte.weight" in {f["parameter"] for f in gpt2}
    assert not any(".ln_" in f["parameter"] or f["parameter"].endswith(".bias") for f in gpt2)
    assert {f["fix"] for f in gpt2} == {
        "model = transformers.AutoModelForCausalLM.from_config(config)"}
    expect_output(checked, output_file(SNIPPET))


def test_the_fixed_loop_wraps_the_line_the_checker_names(found):
    """The fix for the loss of issue #1047 names a line of the loop; the loop with the fix
    applied (on the page) puts that same line first in its block."""
    example = runpy.run_path(str(ROOT / SNIPPET), run_name="lines")
    (finding,) = found["loss_reads_the_weight"]
    line = int(finding["where"].split("`")[1].split(":")[1])
    source = (ROOT / SNIPPET).read_text().splitlines()
    fixed = source[example["loss_reads_the_weight_fixed"].__code__.co_firstlineno - 1:]
    block = next(i for i, text in enumerate(fixed) if "with loop_fixes(" in text)
    assert fixed[block + 1].strip() == source[line - 1].strip()
    assert any("engine.backward(loss)" in text for text in fixed[block + 1:block + 4])


def same_training(got, want):
    return "error" not in got and matches(got["losses"], want["losses"]) and matches(
        got["grads"], want["grads"])


def test_every_flagged_example_is_mended_by_its_fixes(found):
    fixes = {name: findings for name, findings in found.items() if findings}
    assert len(fixes) == 4
    env = {"CHECK_FIXES": json.dumps(fixes)}
    runs = run_snippet(SNIPPET, 2, call="mended", env=env, timeout=600).check().returned(0)
    for name, run in runs.items():
        plain = run["plain"]
        reference = run.get("plain init", plain["initial"])  # Transformers' init, or as built
        common = reference.keys() & run["fixed"]["initial"].keys()
        assert matches({n: run["fixed"]["initial"][n] for n in common},
                       {n: reference[n] for n in common}), name
        assert same_training(run["fixed"], plain), (name, run["fixed"].get("error"))
        # As it is, the run fails, or starts from other weights than the init intends.
        as_it_is = run["as it is"]
        assert "error" in as_it_is or not matches(
            {n: as_it_is["initial"][n] for n in common}, {n: reference[n] for n in common}), name
