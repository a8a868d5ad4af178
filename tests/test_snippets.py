"""Every snippet runs with its documented rank count and prints exactly its output file."""

import pytest

from rankrun.pages import all_snippets, documented_world_size, output_file, runs_before
from rankrun.runner import run_snippet

# Snippets that need more than the runner's default timeout: automatic_detection.py trains
# every case of its page's tables (78 ZeRO-3 runs) in one launch; under coverage on a loaded
# machine that took more than 120 s.
TIMEOUTS = {
    "snippets/zero3/automatic_detection.py": 600.0,
    # 11 ZeRO-3 trainings of a 4 MiB embedding; about 90 s in the warm pool on a loaded machine.
    "snippets/zero3/sharing_cost.py": 600.0,
}


@pytest.mark.parametrize("snippet", all_snippets(), ids=str)
def test_snippet_prints_its_output_file(snippet, expect_output):
    # An example that reads what another wrote (a checkpoint) says so in its docstring; that run
    # comes first (in a test session it is made once, and its files stay in the session's TMPDIR).
    for other, ranks in runs_before(snippet):
        run_snippet(other, world_size=ranks, timeout=TIMEOUTS.get(other, 120.0)).check()
    result = run_snippet(snippet, world_size=documented_world_size(snippet), timeout=TIMEOUTS.get(str(snippet), 120.0))
    expect_output(result, output_file(snippet))
