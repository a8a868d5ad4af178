"""ModuleZ3 (the corrected upstream example) under ZeRO-3 equals plain PyTorch, with and without
the registration; the registered weight is gathered at the start of ModuleZ3.forward and
partitioned again after backward; the upstream example as shipped fails in its constructor."""

import textwrap

import deepspeed

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace, train_in_one_process
from rankrun.results import assert_refused
from rankrun.runner import ROOT, run_snippet

SNIPPET = "snippets/zero3/module_z3.py"
PAGE = ROOT / "docs/zero3/external-parameters.md"
UPSTREAM_ERROR = "ModuleZ3.__init__() takes 1 positional argument but 2 were given"


def train_without_deepspeed():
    example = example_namespace(SNIPPET)
    torch.manual_seed(example["SEED"])
    return train_in_one_process(
        example["ModuleZ3"](),
        (example["make_batch"](step) for step in range(example["STEPS"])),
        F.mse_loss,
        example["LR"],
    )


@pytest.fixture(scope="module")
def reference():
    return train_without_deepspeed()


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_matches_plain_pytorch(world_size, reference, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert_same_training(got, reference)
        # Outside forward the weight is empty; its real shape is in ds_shape.
        assert got["ds_shape"] == (8, 8)
        # What the page says DeepSpeed does with the registered weight.
        first, *later = got["watched"]
        assert first == [
            ("start of ModuleZ3.forward", (8, 8), "AVAILABLE"),
            ("end of ModuleZ3.forward", (0,), "NOT_AVAILABLE"),
            ("after engine.backward", (0,), "NOT_AVAILABLE"),
        ]
        assert later and all(
            steps == [
                ("start of ModuleZ3.forward", (8, 8), "AVAILABLE"),
                ("end of ModuleZ3.forward", (8, 8), "AVAILABLE"),
                ("after engine.backward", (0,), "NOT_AVAILABLE"),
            ]
            for steps in later
        ), later
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


def test_without_registration_deepspeed_detects_the_read(reference):
    """ModuleZ3 reads self.layer1.weight as an attribute in its forward: the automatically detected case."""
    example = example_namespace(SNIPPET)
    # The variant really registers nothing (register_external_parameter works without ZeRO-3 too).
    assert hasattr(example["ModuleZ3"](), "_external_params")
    assert not hasattr(example["ModuleZ3WithoutRegistration"](), "_external_params")
    result = run_snippet(SNIPPET, 2, call="main_without_registration").check()
    for rank in range(2):
        assert_same_training(result.returned(rank), reference)


def upstream_module_z3() -> str:
    """The ModuleZ3 example as the pinned DeepSpeed ships it, in register_external_parameter's docstring."""
    doc = deepspeed.zero.register_external_parameter.__doc__
    start = doc.index("class ModuleZ3")
    return textwrap.dedent(doc[doc.rindex("\n", 0, start) + 1:]).strip()


@marks.message
def test_upstream_example_is_quoted_and_its_constructor_raises():
    code = upstream_module_z3()
    assert "# self.layer1.weight is required by self.layer2.forward" in code
    assert "super().__init__(self, *args)" in code
    page = PAGE.read_text()
    assert code in page, "the page quotes the upstream example verbatim"
    namespace = {"torch": torch, "deepspeed": deepspeed}
    exec(code, namespace)  # SomeLayer and OtherLayer are never reached: super().__init__ raises first
    with pytest.raises(TypeError) as raised:
        namespace["ModuleZ3"]()
    assert str(raised.value) == UPSTREAM_ERROR
    assert raised.traceback[-1].path.as_posix().endswith("torch/nn/modules/module.py")
    assert f"TypeError: {UPSTREAM_ERROR}" in page


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
