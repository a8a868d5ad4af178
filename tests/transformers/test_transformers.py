"""docs/zero3/transformers.md: the page shows these runs' output files and messages."""

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import ROOT

pytestmark = marks.files


TINY = "snippets/transformers/tiny_t5.py"
READER = "snippets/transformers/t5_reader.py"
FIXES = "snippets/transformers/t5_fixes.py"
PAGE = ROOT / "docs/zero3/transformers.md"
OUTSIDE_PAGE = ROOT / "docs/zero3/outside-forward.md"
READER_INDEX_ERROR = "Dimension out of range (expected to be in range of [-1, 0], but got 1)"


def test_the_pages_show_these_runs():
    page = PAGE.read_text()
    for snippet in (TINY, READER, FIXES):
        assert f'--8<-- "{output_file(snippet).relative_to(ROOT)}"' in page, snippet
    # The reader's exact message is in an output file the page includes.
    assert f"IndexError: {READER_INDEX_ERROR}" in output_file(READER).read_text()
    outside = OUTSIDE_PAGE.read_text()
    assert "Not tested here" not in outside
    assert f'--8<-- "{output_file(READER).relative_to(ROOT)}"' in outside
    for linking in (outside, (ROOT / "docs/zero3/troubleshooting.md").read_text()):
        assert "(transformers.md)" in linking
