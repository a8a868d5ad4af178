"""snippets/transformers/load_report.py on 2 and 4 ranks: under ZeRO-3 on the pinned
Transformers, from_pretrained reports no weight missing, for a Mixtral whose checkpoint keeps one
matrix per expert and for a model of raw nn.Parameter weights, and every weight, gathered,
equals the same checkpoint loaded in one process, on every rank. (Transformers 5.0.0, which
reports most of the Mixtral's weights missing, runs in the version matrix.)"""

import pytest

from rankrun.pages import output_file
from rankrun.runner import run_snippet

SNIPPET = "snippets/transformers/load_report.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
WEIGHTS = {"MixtralForCausalLM": 12, "ScaledExperts": 3}


@pytest.mark.kernel_independent(
    reason="weights loaded and gathered, compared bit for bit: no computed value")
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_weight_arrives_under_zero3(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got == {name: {"missing": [], "differ": [], "weights": count}
                       for name, count in WEIGHTS.items()}, (rank, got)
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
