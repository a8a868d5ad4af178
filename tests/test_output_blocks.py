"""Output blocks say what they are, the same way on every page.

An output file (snippets/**/*.out) holds the runner's transcript (rankrun/runner.py,
RunResult.transcript): each rank's stdout, rank after rank, without DeepSpeed's log lines,
then, for a run that failed, one `Type: message` line per distinct exception. That is not
exactly what `torchrun` prints, so every block that includes one is introduced by one of two
fixed phrases, with a link to docs/testing.md#output-blocks, which says what the block leaves
out. The second test runs a failing example with the real torchrun and checks what that
section says about stdout and stderr.
"""

from __future__ import annotations

import re

import pytest

from rankrun.pages import output_file
from rankrun.runner import DEEPSPEED_NOISE, check_torchrun, printed_by_the_example, run_torchrun
from rankrun.pages import ONLY_RANK_0, doc_pages as pages
from rankrun.pages import normalise, output_blocks, page_lines, page_name, page_outputs

# The runner's transcript (rankrun/runner.py RunResult.transcript) is what an output file holds:
# each rank's stdout, rank after rank (torchrun interleaves them), without DeepSpeed's log
# lines, then one line per distinct exception of the ranks that failed first. So every block
# that includes one is introduced by the same words, on every page; docs/testing.md#output-blocks
# says what the block leaves out (stderr: warnings, tracebacks, torchrun's own report).
LABEL = "The stdout of each rank, rank by rank ([what this block leaves out]):"
LABEL_FAILED = "The stdout of each rank, rank by rank, then the exception the ranks raised ([what this block leaves out]):"
LABEL_LINK = re.compile(r"\[what this block leaves out\]\(([^)]*)\)")
# A line the runner adds to a transcript: `Type: message` of an exception, or how a rank ended.
RUNNER_LINE = re.compile(r"^(?:\w+(?:Error|Exception|Interrupt): |rank \d+ (?:exited with code|killed by signal) )", re.M)
RUNNER_LINE_FULL = re.compile(RUNNER_LINE.pattern + r".*\n?", re.M)


def label_problems(page_name: str, lines: list[str]) -> list[str]:
    problems = []
    texts = {spec: text for spec, text in page_outputs(lines)}
    for line, paragraph, included in output_blocks(lines):
        outputs = [spec for spec, _ in included]
        failed = any(RUNNER_LINE.search(texts[spec]) for spec in outputs)
        wanted = LABEL_FAILED if failed else LABEL
        link = LABEL_LINK.search(paragraph)
        said = normalise(LABEL_LINK.sub("[what this block leaves out]", paragraph)).replace(ONLY_RANK_0, "")
        target = "testing.md#output-blocks"
        if not said.endswith(wanted):
            problems.append(
                f"docs/{page_name}:{line}: the block with {', '.join(outputs)} must be introduced by "
                f"{wanted!r} (with the link to {target}), right before it; the page has {paragraph[-120:]!r}"
            )
        elif not (link and link.group(1).endswith(target.removeprefix("testing.md" if page_name == "testing.md" else ""))):
            problems.append(f"docs/{page_name}:{line}: the label's link must point to {target}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=page_name)
def test_every_output_block_is_labelled_for_what_it_is(page):
    problems = label_problems(page_name(page), page_lines(page))
    assert not problems, "\n" + "\n".join(problems)


FAILING_EXAMPLE = "snippets/zero3/soft_inputs_outside.py"
TRAINING_EXAMPLE = "snippets/zero3/language_model.py"
ALL_GATHER_WARNING = "FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated"
REDUCE_SCATTER_WARNING = "FutureWarning: `torch.distributed.reduce_scatter_tensor` is deprecated"


@pytest.mark.slow  # torchrun and two new interpreters, for what the reader sees on stderr
@pytest.mark.runs(FAILING_EXAMPLE)
def test_torchrun_shows_what_the_block_leaves_out():
    """What docs/testing.md#output-blocks says about a real torchrun run of a failing example."""
    done = run_torchrun(FAILING_EXAMPLE)
    block = output_file(FAILING_EXAMPLE).read_text()
    added = RUNNER_LINE_FULL.findall(block)
    assert done.returncode != 0 and added, (done.returncode, block)
    # stdout: the block's printed part, plus DeepSpeed's log lines, which the block leaves out.
    assert printed_by_the_example(done.stdout) == RUNNER_LINE_FULL.sub("", block)
    assert any(DEEPSPEED_NOISE.match(line) for line in done.stdout.splitlines()), done.stdout
    # stderr: each rank's traceback, every line prefixed by its rank, ending in the block's line.
    for rank in (0, 1):
        assert f"[rank{rank}]: Traceback (most recent call last):" in done.stderr
        for line in added:
            assert f"[rank{rank}]: {line.rstrip()}\n" in done.stderr
    # ... torchrun's own report, its OMP_NUM_THREADS notice, and torch's deprecation warning.
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in done.stderr
    assert "Setting OMP_NUM_THREADS environment variable for each process" in done.stderr
    assert ALL_GATHER_WARNING in done.stderr


@pytest.mark.slow  # torchrun and two new interpreters, for what the reader sees on stderr
@pytest.mark.runs(TRAINING_EXAMPLE)
def test_torchrun_warnings_of_a_training_example():
    """A ZeRO-3 example that trains: its block is its stdout without DeepSpeed's log lines; stderr
    repeats torch's deprecation warnings for the collectives DeepSpeed calls."""
    done = check_torchrun(run_torchrun(TRAINING_EXAMPLE))
    assert printed_by_the_example(done.stdout) == output_file(TRAINING_EXAMPLE).read_text()
    assert any(DEEPSPEED_NOISE.match(line) for line in done.stdout.splitlines()), done.stdout
    assert "Setting OMP_NUM_THREADS environment variable for each process" in done.stderr
    # more than once per rank: the page says "repeated"
    assert done.stderr.count(ALL_GATHER_WARNING) > 2 and done.stderr.count(REDUCE_SCATTER_WARNING) > 2, done.stderr
