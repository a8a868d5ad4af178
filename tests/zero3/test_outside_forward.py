"""docs/zero3/outside-forward.md: the page shows the messages its examples' runs printed."""

import re

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import ROOT

pytestmark = marks.files


GATHERED = "snippets/zero3/gathered_parameters.py"
PAGE = ROOT / "docs/zero3/outside-forward.md"
GATHER_DEPRECATED = (
    "`torch.distributed.all_gather_into_tensor` is deprecated. "
    "Please use `torch.distributed.all_gather_single` instead."
)
GUARD = (
    "Detected in-place modification of ZeRO-3 parameters inside GatheredParameters with "
    "modifier_rank=None. Use modifier_rank=<rank> to broadcast updates across ranks."
)


def test_page_shows_the_messages():
    page = PAGE.read_text()
    for message in ["mat2 must be a matrix", GUARD]:
        assert message in page, message
    # The one warning recorded while a change is lost is named where the pages say so.
    named = "`torch.distributed.all_gather_into_tensor` is deprecated"
    assert GATHER_DEPRECATED.startswith(named)
    for page_text in (page, (ROOT / "docs/zero3/troubleshooting.md").read_text()):
        assert named in page_text
    # Output excerpts typed on the page (```text blocks that are not includes) are lines of
    # the output files the runs wrote.
    printed = output_file(GATHERED).read_text().splitlines()
    blocks = re.findall(r"```text\n(.*?)```", page, flags=re.S)
    excerpts = [line for block in blocks if "--8<--" not in block for line in block.splitlines()]
    assert excerpts
    for line in excerpts:
        assert any(line in printed_line for printed_line in printed), line
