"""lost_writes.py: nn.Embedding(max_norm=...) under ZeRO-3 trains otherwise than in one
process, without an error (its forward's renormalisation is lost: the rows keep their
norms), under a persistence threshold of 0 and under DeepSpeed's default; renormalised in
the loop on both of ZeRO-3's copies it trains like one process; on 2 and on 4 ranks."""

import pytest

from rankrun.pages import output_file
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/zero3/lost_writes.py"
MAX_NORM = 0.5


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_write_is_lost_and_the_fix_keeps_it(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for rank in range(world_size):
        runs = result.returned(rank)
        want = runs["one process"]
        assert want["norm"] <= MAX_NORM * 1.1  # renormalised, then one SGD step
        fixed = runs["renormalised in the loop"]
        assert_matches(fixed["losses"], want["losses"], "renormalised in the loop")
        assert_matches(fixed["grads"], want["grads"], "renormalised in the loop")
        assert_matches(fixed["norm"], want["norm"], "renormalised in the loop")
        for case in ("as written", "as written, default persistence threshold"):
            lost = runs[case]
            assert matches(lost["losses"][0], want["losses"][0]), case  # the first forward
            assert not matches(lost["losses"], want["losses"]), case  # then it drifts
            assert not matches(lost["grads"], want["grads"]), case
            assert lost["norm"] > 4 * MAX_NORM, (case, lost["norm"])  # never renormalised
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
