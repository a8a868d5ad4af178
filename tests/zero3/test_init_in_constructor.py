"""snippets/zero3/init_in_constructor.py: under zero.Init, an initialization through
`self.apply(fn)` gives every weight exactly as the same model built in one process; the same
function called in a loop over `self.modules()`, and a direct `.data.mul_`, are lost without
an error: the weights are those of the model built without that initialization. On 2 and 4
ranks, on every rank."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet

SNIPPET = "snippets/zero3/init_in_constructor.py"
APPLY = "self.apply(self._init_weights)"


@pytest.fixture(scope="module")
def example():
    return example_namespace(SNIPPET)


def built_in_one_process(example, init):
    torch.manual_seed(example["SEED"])
    model = example["LanguageModel"](init)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def equal(got, want):
    return got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("world_size", [2, 4])
def test_apply_gathers_and_a_direct_change_is_lost(world_size, example, expect_output):
    untouched = built_in_one_process(example, None)
    wants = {init: built_in_one_process(example, init) for init in example["INITS"]}
    for init, want in wants.items():  # each initialization changes the model in one process
        assert not equal(want, untouched), init
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert list(got) == example["INITS"]
        for init, want in wants.items():
            zero3, label = got[init]["zero3"], f"rank {rank} {init}"
            assert equal(got[init]["one process"], want), label
            if init == APPLY:
                assert equal(zero3, want), label
            else:  # no error, and the weights are as if the constructor had not changed them
                assert equal(zero3, untouched) and not equal(zero3, want), label
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
