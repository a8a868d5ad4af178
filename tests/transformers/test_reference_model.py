"""snippets/transformers/reference_model.py: a frozen teacher beside a ZeRO-3 student on 2 and
4 ranks. Built under ZeRO-3 and never initialized, its forward fails with the exact message;
as its own engine (by hand, and by trl's prepare_deepspeed) or built outside ZeRO-3, its
logits and the student's training equal the same models in one process without DeepSpeed."""

import pytest
import torch

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/reference_model.py"
TIMEOUT = 600  # Transformers, trl and four engines on a loaded 2-core machine
FAILS = "RuntimeError: 'weight' must be 2-D"


@pytest.fixture(scope="module")
def reference():
    """Student and teacher in this one process: same weights (same seeds), batch, loss, SGD."""
    example = example_namespace(SNIPPET)
    student = example["tiny_llama"](example["STUDENT_SEED"])
    teacher = example["tiny_llama"](example["TEACHER_SEED"]).eval()
    assert not hasattr(student.model.embed_tokens.weight, "ds_shape")  # not partitioned
    tokens = example["batch"]()
    optimizer = torch.optim.SGD(student.parameters(), lr=example["LR"])
    losses, grads = [], []
    with torch.no_grad():
        teacher_logits = teacher(tokens).logits
    for _ in range(example["STEPS"]):
        loss = example["distillation_loss"](student(tokens).logits, teacher_logits, tokens)
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in student.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return (losses, grads), teacher_logits


@pytest.mark.parametrize("world_size", [2, 4])
def test_teacher_fixes_equal_one_process(world_size, reference, expect_output):
    training, teacher_logits = reference
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["fails"][0] == FAILS, got["fails"]
        assert got["teacher_shape"] == (0,)  # partitioned: this rank holds none of it in view
        for fix in ("engine", "trl", "outside"):
            label = f"{fix}, rank {rank}"
            assert_matches(got[fix]["teacher_logits"], teacher_logits[rank::world_size],
                           f"{label} teacher logits")
            assert_same_training(got[fix], training, label)
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main", timeout=TIMEOUT)
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
