"""check_shared_reads.py: its verdict on every cell of the automatic-detection tables is the
outcome those runs show (tests/zero3/test_automatic_detection.py asserts the runs), and the
command exits with 1 on a finding and 0 without one."""

import os
import runpy
import subprocess
import sys

import pytest

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace, predicted_outcome
from rankrun.runner import ROOT, check_torchrun, printed_by_the_example, run_snippet, run_torchrun

SNIPPET = "snippets/zero3/check_shared_reads.py"
EXAMPLES = "snippets/zero3/check_examples.py"
COMPARE = runpy.run_path(str(ROOT / "benchmarks/check_shared_reads_architectures.py"))


@marks.findings
def test_agrees_with_every_cell_of_the_automatic_detection_tables():
    example = example_namespace("snippets/zero3/automatic_detection.py")
    # 78 checker runs in one process.
    found = run_snippet(EXAMPLES, 1, call="check_tables", timeout=600).check().returned(0)
    assert found.keys() == example["cases"]().keys()
    for key, by_register in found.items():
        for register, findings in by_register.items():
            expected = predicted_outcome(example, key, register)
            label = f"{key} register={register}: {findings}"
            if expected is None:  # the run equals plain PyTorch
                assert findings == [], label
            else:  # fails or silently wrong: the checker names the weight
                assert {f["parameter"] for f in findings} == {"embeddings.weight"}, label
    for key, by_register in found.items():
        for findings in by_register.values():
            COMPARE["assert_user_can_write"](findings, key)
    before = found["`self.embeddings.weight`", "before", example["FIRST_USE"]][False]
    assert before == [{"parameter": "embeddings.weight", "reader": "(model)", "phase": "forward",
                       "step": 0, "fix": "deepspeed.zero.register_external_parameter(self, "
                                         "self.embeddings.weight)",
                       "where": "at the end of `Probe.__init__`", "kind": "use"}]
    head = found["a list holding the Parameter: `self.tied[0]`", "head", example["FIRST_USE"]][False]
    assert [(f["reader"], f["fix"], f["where"]) for f in head] == [
        ("head", "deepspeed.zero.register_external_parameter(self.head, self.embeddings.weight)",
         "at the end of `Probe.__init__`")]
    outside = found["read outside any forward, in the training loop",][True]
    assert [(f["reader"], f["phase"]) for f in outside] == [("(outside any forward)", "loop")]
    changed = found["changed in a constructor, after `zero.Init` partitioned it",][False]
    assert [(f["phase"], f["step"]) for f in changed] == [("constructor", None)]


def command(target):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, SNIPPET, target], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@marks.findings
def test_command_exits_1_on_a_finding_and_0_without():
    found = command(f"{EXAMPLES}:tied_through_a_list")
    assert found.returncode == 1, found.stderr[-2000:]
    assert ("  fix, at the end of `TiedThroughAList.__init__`:\n"
            "    deepspeed.zero.register_external_parameter(self, self.embeddings.weight)\n"
            ) in found.stdout
    clean = command(f"{EXAMPLES}:language_model")
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert "No findings" in clean.stdout


@marks.findings
def test_example_without_arguments(expect_output):
    result = run_snippet(SNIPPET, 1).check()
    assert "embeddings.weight" in result.output
    expect_output(result, output_file(SNIPPET))


@pytest.mark.slow  # torchrun and a new interpreter: what the pool saves everywhere else
@marks.findings
def test_the_documented_torchrun_command_prints_the_output_file():
    """The page's command, run for real: under torchrun the checker joins torchrun's
    rendezvous (its agent holds the store) instead of starting a group of its own, which would
    wait forever for a store nobody serves."""
    command = "DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 snippets/zero3/check_shared_reads.py"
    assert command in (ROOT / "docs/zero3/check-your-model.md").read_text()
    done = check_torchrun(run_torchrun(SNIPPET, 1, timeout=300))
    assert printed_by_the_example(done.stdout) == output_file(SNIPPET).read_text()
