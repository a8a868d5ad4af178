"""The code blocks on the pages, read as the build reads them (pymdownx.snippets expands each
`--8<--` include with the build's settings): every included section is Python on its own,
and a block that backpropagates also steps, unless the page is listed below with its reason.

A reader copies a block, not the file behind it: a loop that calls `engine.backward(loss)`
and stops there never trains.
"""

import ast
import re

import pytest

from rankrun.pages import DOCS, code_blocks, expanded, includes
from rankrun.runner import ROOT

BACKWARD = re.compile(r"\b(?:engine|loss|model)\w*\.backward\(")
STEP = re.compile(r"\.step\(")

# (page, block title, first line of the block) -> why that block backpropagates without stepping.
WITHOUT_STEP: dict[tuple[str, str, str], str] = {
    ("docs/zero3/outside-forward.md", "snippets/zero3/gathered_in_loss.py",
     "def backward_inside_the_block(engine, sampled_input, targets):"):
        "a loss function that also backpropagates, in place of compute_loss + engine.backward; "
        "the page says the training loop steps after it",
    ("docs/zero3/fused-loss.md", "snippets/transformers/fused_loss.py",
     "def backward_inside_the_block(engine, tokens):"):
        "a placement of the loss that also backpropagates; the page says each placement trains "
        "the model three steps",
    ("docs/zero3/check-your-model.md", "snippets/zero3/check_examples.py",
     "def loss_reads_the_weight_fixed(engine, inputs, findings):"):
        "the loss of a training loop with the checker's fix applied; the page says each fixed "
        "example trains 3 steps",
    ("docs/zero3/check-your-model.md", "snippets/zero3/check_architectures.py",
     "def chunked_step_with_fix(engine, inputs, findings):"):
        "one step's loss and backward with the checker's fix applied; the page says the run "
        "trains 3 steps of SGD",
}


def problems_of(page_text: str, page: str = "page") -> list[str]:
    """What is wrong with the Python blocks of one page's Markdown."""
    found = []
    for line, title, code in code_blocks(expanded(page_text)):
        where = f"{page}:{line} ({title or 'untitled block'})"
        try:
            ast.parse(code)
        except SyntaxError as error:
            found.append(f"{where}: not Python on its own: {error.msg} at its line {error.lineno}")
            continue
        first = code.strip().splitlines()[0] if code.strip() else ""
        if BACKWARD.search(code) and not STEP.search(code) and (page, title, first) not in WITHOUT_STEP:
            found.append(f"{where}: calls backward but never steps: show the step (move the "
                         f"section's [end:...] marker), or list the block in WITHOUT_STEP with the reason")
    return found


PAGES = sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_parses_and_a_block_that_backpropagates_also_steps(page):
    assert problems_of(page.read_text(), str(page.relative_to(ROOT))) == []


PY_SECTIONS = sorted({(path, section) for _, path, section in includes() if section and path.endswith(".py")})


@pytest.mark.parametrize("path, section", PY_SECTIONS, ids=lambda v: str(v))
def test_every_included_section_is_python_on_its_own(path, section):
    code = code_blocks(f'```python\n--8<-- "{path}:{section}"\n```\n')[0][2]
    assert code.strip(), f"{path}:{section} is empty"
    try:
        ast.parse(code)
    except SyntaxError as error:
        pytest.fail(f"{path}:{section} is not Python on its own: {error.msg} at its line {error.lineno}:\n{code}")


def test_the_check_finds_a_loop_that_never_steps_and_a_section_that_is_not_python(tmp_path, monkeypatch):
    """The class of defect, in a page made for the test: a section that ends after backward,
    and a section cut in the middle of a statement."""
    snippet = ROOT / "snippets" / "zero3" / "soft_inputs_wrapper.py"
    text = snippet.read_text()
    start, end = "# --8<-- [start:train]\n", "    # --8<-- [end:train]\n"
    assert start in text and end in text
    body = text[text.index(start) + len(start):text.index(end)]
    cut = body[:body.index("engine.backward(loss)\n") + len("engine.backward(loss)\n")]
    page = f'```python title="x.py"\n{cut}```\n'
    assert any("calls backward but never steps" in p for p in problems_of(page))
    assert problems_of(f'```python title="x.py"\n{body}```\n') == []
    broken = f'```python title="x.py"\n{cut.replace("engine.backward(loss)", "engine.backward(loss")}```\n'
    assert any("not Python on its own" in p for p in problems_of(broken))
