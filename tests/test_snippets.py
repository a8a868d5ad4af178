"""Every snippet runs with its documented rank count and prints exactly its output file."""

import pytest

from rankrun.pages import RUN_FRESH, all_snippets, documented_world_size, output_file, runs_before
from rankrun.runner import run_snippet

# Snippets that need more than the runner's default timeout: automatic_detection.py trains
# every case of its page's tables (78 ZeRO-3 runs) in one launch; under coverage on a loaded
# machine that took more than 120 s.
TIMEOUTS = {
    "snippets/zero3/automatic_detection.py": 600.0,
    # 11 ZeRO-3 trainings of a 4 MiB embedding; about 90 s in the warm pool on a loaded machine.
    "snippets/zero3/sharing_cost.py": 600.0,
    # Importing Transformers in new interpreters (below), on a loaded machine.
    "snippets/transformers/import_inside_zero_init.py": 600.0,
    "snippets/transformers/import_first_zero_init.py": 600.0,
    "snippets/transformers/hf_config_zero_init.py": 600.0,
    # Ten new interpreters of its own, most of them importing Transformers.
    "snippets/transformers/first_imports_inside_zero_init.py": 900.0,
}

# Snippets whose outcome depends on what the process imported before them: the warm pool's
# ranks have imported torch._dynamo, so these run in new interpreters, as torchrun starts them.
FRESH = RUN_FRESH


@pytest.mark.parametrize("snippet", all_snippets(), ids=str)
def test_snippet_prints_its_output_file(snippet, expect_output):
    # An example that reads what another wrote (a checkpoint) says so in its docstring; that run
    # comes first (in a test session it is made once, and its files stay in the session's TMPDIR).
    for other, ranks in runs_before(snippet):
        run_snippet(other, world_size=ranks, timeout=TIMEOUTS.get(other, 120.0)).check()
    result = run_snippet(snippet, world_size=documented_world_size(snippet), timeout=TIMEOUTS.get(str(snippet), 120.0),
                         fresh=str(snippet) in FRESH)
    expect_output(result, output_file(snippet))
