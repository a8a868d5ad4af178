"""`--update-outputs` records a failed run only for an example documented as failing.

The first test runs a child pytest session with `--update-outputs` on a scratch project (its
own mkdocs.yml, page, snippets and output files; RANKRUN_PROJECT points the harness at it), so
the real output files are never touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rankrun.plugin import documented_failure
from rankrun.runner import ROOT

LABEL = "The stdout of each rank, rank by rank ([what this block leaves out](testing.md#output-blocks)):"
LABEL_FAILED = ("The stdout of each rank, rank by rank, then the exception the ranks raised "
                "([what this block leaves out](testing.md#output-blocks)):")
PAGE = f"""# Scratch

{LABEL}

```text
--8<-- "snippets/demo/trains.out"
```

{LABEL}

```text
--8<-- "snippets/demo/broken.out"
```

{LABEL_FAILED}

```text
--8<-- "snippets/demo/meant_to_fail.out"
```

{LABEL_FAILED}

```text
--8<-- "snippets/demo/fails_otherwise.out"
```
"""
SNIPPETS = {
    # name: (what main() does, the committed output file)
    "trains": ('print("step 0: loss 0.5")', "step 0: loss 0.9\n"),
    # An example that should train, broken: its run raises.
    "broken": ('print("step 0: loss 0.5")\n    raise ValueError("probe")', "step 0: loss 0.5\nstep 1: loss 0.4\n"),
    # Meant to fail; the message changed since the output file was written.
    "meant_to_fail": ('raise RuntimeError("mat2 must be a matrix")', "RuntimeError: an older message\n"),
    # Meant to fail with a RuntimeError; now fails with another exception.
    "fails_otherwise": ('raise TypeError("unexpected")', "RuntimeError: mat2 must be a matrix\n"),
}
TEST_MODULE = """
from pathlib import Path

import pytest

from rankrun.pages import output_file
from rankrun.runner import run_snippet


@pytest.mark.parametrize("name", ["trains", "broken", "meant_to_fail", "fails_otherwise"])
def test_example(name, expect_output):
    snippet = Path("snippets", "demo", f"{name}.py")
    expect_output(run_snippet(snippet, world_size=1, fresh=True, timeout=60), output_file(snippet))
"""


def make_project(root: Path) -> None:
    (root / "mkdocs.yml").write_text("site_name: scratch\n")
    (root / "docs").mkdir()
    (root / "docs" / "page.md").write_text(PAGE)
    (root / "snippets" / "demo").mkdir(parents=True)
    for name, (body, committed) in SNIPPETS.items():
        (root / "snippets" / "demo" / f"{name}.py").write_text(
            f'"""torchrun --nproc_per_node 1 snippets/demo/{name}.py"""\n\n\ndef main():\n    {body}\n\n\n'
            f'if __name__ == "__main__":\n    main()\n')
        (root / "snippets" / "demo" / f"{name}.out").write_text(committed)
    (root / "tests").mkdir()
    (root / "tests" / "test_demo.py").write_text(TEST_MODULE)
    (root / "tmp").mkdir()


def test_update_outputs_records_a_failure_only_where_a_page_shows_it(tmp_path):
    make_project(tmp_path)
    env = {**os.environ, "RANKRUN_PROJECT": str(tmp_path), "TMPDIR": str(tmp_path / "tmp")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rf",
         "--update-outputs", "tests/test_demo.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    outputs = {name: (tmp_path / "snippets" / "demo" / f"{name}.out").read_text() for name in SNIPPETS}
    assert done.returncode == 1, out
    assert "2 failed, 2 passed" in out, out
    # A run that succeeds is recorded; so is a documented failure with its new message.
    assert outputs["trains"] == "step 0: loss 0.5\n"
    assert outputs["meant_to_fail"] == "RuntimeError: mat2 must be a matrix\n"
    # A failure no page documents is not recorded, and the session says why.
    assert outputs["broken"] == SNIPPETS["broken"][1]
    assert ("snippets/demo/broken.py failed under "
            "--update-outputs, and it is not documented as an example meant to fail (no page that includes "
            "snippets/demo/broken.out introduces it as \"..., then the exception the ranks raised\"), so "
            "snippets/demo/broken.out was left as it is, and the run failed:") in out
    assert "ValueError: probe" in out
    # Another exception than the one the page shows is not recorded either.
    assert outputs["fails_otherwise"] == SNIPPETS["fails_otherwise"][1]
    assert ("snippets/demo/fails_otherwise.py is documented as failing with RuntimeError "
            "(snippets/demo/fails_otherwise.out), but this run ended with TypeError;") in out
    assert list((tmp_path / "tmp").iterdir()) == []


def test_the_failing_examples_of_the_pages_are_the_documented_ones():
    """The rule reads the real pages: the blocks introduced as ending in an exception."""
    snippets = ROOT / "snippets"
    failing = sorted(str(out.relative_to(ROOT)) for out in snippets.rglob("*.out") if documented_failure(out))
    assert failing == ["snippets/pipeline/fsdp_tied.out", "snippets/pipeline/hf_pipeline_loader.out",
                       "snippets/pipeline/zero3_pipeline.out",
                       "snippets/transformers/import_inside_zero_init.out", "snippets/zero3/copied_layers.out",
                       "snippets/zero3/prefetch_trace.out", "snippets/zero3/soft_inputs_outside.out"]
    assert documented_failure(snippets / "pipeline" / "fsdp_tied.out") == "docs/pipeline/tied-layers.md"
