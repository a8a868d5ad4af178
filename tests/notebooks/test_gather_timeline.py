"""snippets/notebooks/gather_timeline.py prints rank 0's losses: it runs on 2 ranks only."""

import pytest

from rankrun.results import assert_refused
from rankrun.runner import run_snippet

SNIPPET = "snippets/notebooks/gather_timeline.py"


@pytest.mark.parametrize("world_size", [3, 4])
def test_another_rank_count_is_refused(world_size):
    """Rank 0's losses are those of its share of the 8 samples: 3 of them on 3 ranks, 2 on 4,
    4 on the 2 ranks the page shows. The example says so instead of printing other numbers,
    even on 4 ranks, where the batch splits evenly."""
    result = run_snippet(SNIPPET, world_size, call="main")
    assert_refused(result, (
        f"ValueError: rank 0's losses differ on {world_size} ranks (they are those of its "
        "share of the batch); run on 2 ranks (the printed output was checked there)"))
