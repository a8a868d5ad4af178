"""snippets/zero3/prefetch_trace.py: a weight read in some forwards only stops a ZeRO-3 step with
"tracing error at step N: ... expected the next K parameters in the parameter fetch queue",
once the module order was recorded without the read. On 2 and 4 ranks as the page shows it
(read on odd steps: step 1's backward stops); and on 2 ranks the rule beyond that case: read
on step 2 only (steps 0 and 1 print plain PyTorch's losses, step 2's backward stops), read only
while generating (the next generation forward stops; the queue holds embeddings.weight and
layer.weight), without prefetching (the same error, the same queue), under DeepSpeed's default
persistence threshold (no error for a head of 128 elements, kept whole, which still gets its
step-1 gradient again in step 2; the error, in step 1, for a head of 102400 elements (a
vocabulary of 12800))."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun import marks
from rankrun.results import printed_by_the_example
from rankrun.runner import run_snippet
from rankrun.tolerance import allowed_difference, assert_matches, matches

SNIPPET = "snippets/zero3/prefetch_trace.py"
EXAMPLE = example_namespace(SNIPPET)
ERROR = "tracing error at step {step}: \nmodule id: 0, training: {training}\nexpected the next {count} parameters in the "
HEAD = "{{'id': 'name=aux.weight id=3', 'status': 'AVAILABLE', 'numel': {numel}, "


def plain(schedule):
    """The schedule (READS' shape) in one process without DeepSpeed: the losses, aux.weight's
    gradient (zeros where a step does not read it), the tokens generated after each step.
    The tests of prefetch_trace_fixes.py build the same reference."""
    train_aux, generate_aux, _ = schedule
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["ReadsHeadWeight"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    losses, grads, generated = [], [], []
    for step in range(EXAMPLE["STEPS"]):
        tokens = EXAMPLE["batch"](step)
        aux = "skipped" if train_aux(step) == "zero" else train_aux(step)  # plain: no read at all
        logits = model(tokens[:, :-1], aux=aux)
        loss = F.cross_entropy(logits.reshape(-1, EXAMPLE["VOCAB"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        grad = model.aux.weight.grad
        grads.append(torch.zeros_like(model.aux.weight) if grad is None else grad.clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if generate_aux is not None:
            model.eval()
            with torch.no_grad():
                sequence = EXAMPLE["batch"](step)[:, :2]
                for _ in range(EXAMPLE["NEW_TOKENS"]):
                    next_token = model(sequence, aux=generate_aux)[:, -1:].argmax(-1)
                    sequence = torch.cat([sequence, next_token], dim=1)
            model.train()
            generated.append(sequence)
    return losses, grads, generated


def assert_printed_losses(result, losses):
    """Rank 0 printed these losses (to 4 decimals): each within the rounding and the tolerance."""
    printed = [float(line.split("loss ")[1].split(",")[0]) for line in result.ranks[0].stdout.splitlines()
               if line.startswith("  step ")]
    assert len(printed) == len(losses), result.ranks[0].stdout
    for got, want in zip(printed, losses):
        assert abs(got - want) <= 0.5e-4 + allowed_difference(want), (got, want)


def assert_stops(result, step, count, numel=128, where="backward", training=True):
    """Every rank raised the tracing error for module 0 (the model) at module call `step`, and
    the parameter it expected and did not find in the queue is aux.weight."""
    assert not result.ok
    for rank in result.ranks:
        exception = rank.exception
        assert exception is not None and exception["name"] == "RuntimeError", rank.rank
        message = exception["message"]
        assert message.startswith(ERROR.format(step=step, count=count, training=training)), message
        assert HEAD.format(numel=numel) in message.split("but got")[0], message
        assert "\nbut got \n (" in message, message
        assert f"pre_sub_module_{where}_function" in exception["traceback"], rank.rank
    assert all(printed_by_the_example(rank.stdout) == "" for rank in result.ranks[1:])
    return result.ranks[0].exception["message"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_weight_read_on_odd_steps_stops_step_1(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size)
    message = assert_stops(result, step=3, count=1)
    # In step 1's backward the model (module 0) runs last: nothing is left in the queue.
    assert message.endswith("but got \n ()."), message
    losses, _, _ = plain(EXAMPLE["READS"]["odd steps"])
    assert_printed_losses(result, losses[:1])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


def test_a_weight_read_on_step_2_only_stops_step_2():
    result = run_snippet(SNIPPET, 2, env={"READ_ON": "step 2 only"})
    assert_stops(result, step=3, count=1)
    losses, _, _ = plain(EXAMPLE["READS"]["step 2 only"])
    assert_printed_losses(result, losses[:2])


def assert_queue_holds_the_model_and_layer_weights(message):
    """The model expected embeddings.weight and aux.weight; the queue held embeddings.weight
    and layer.weight (the record's next entries)."""
    expected, got = message.split("but got")
    assert "'name=embeddings.weight id=0'" in expected and "'name=aux.weight id=3'" in expected, message
    assert "'name=embeddings.weight id=0'" in got and "'name=layer.weight id=1'" in got, message
    assert "aux.weight" not in got, message


def test_a_weight_read_while_generating_stops_the_next_forward():
    """The first generation forward reads aux.weight and adds it to the model's parameters; the
    next one (module 0 at module call 0, in eval mode) finds embeddings.weight first in the
    queue, not aux.weight."""
    result = run_snippet(SNIPPET, 2, env={"READ_ON": "generation only"})
    message = assert_stops(result, step=0, count=2, where="forward", training=False)
    assert_queue_holds_the_model_and_layer_weights(message)
    losses, _, _ = plain(EXAMPLE["READS"]["generation only"])
    assert_printed_losses(result, losses[:1])
    assert "generated" not in result.ranks[0].stdout


def test_without_prefetching_the_same_error():
    result = run_snippet(SNIPPET, 2, env={"ZERO_SETTINGS": "threshold 0, no prefetch"})
    message = assert_stops(result, step=3, count=2)
    assert_queue_holds_the_model_and_layer_weights(message)
    losses, _, _ = plain(EXAMPLE["READS"]["odd steps"])
    assert_printed_losses(result, losses[:1])


def test_under_the_default_threshold_a_small_head_trains_on_with_a_stale_gradient():
    """Kept whole (128 elements, under the default 1e5), aux.weight is never added to the
    model's parameters: no error. Step 2 (no read) still gets step 1's gradient again."""
    result = run_snippet(SNIPPET, 2, env={"ZERO_SETTINGS": "defaults"}, call="main").check()
    losses, grads, _ = plain(EXAMPLE["READS"]["odd steps"])
    for rank in range(2):
        got = result.returned(rank)["odd steps"]
        assert_matches(got["losses"][:3], losses[:3], f"rank {rank}, losses")
        assert_matches(got["grads"][:2], grads[:2], f"rank {rank}, gradients")
        assert not grads[2].any() and got["grads"][1].any()
        assert torch.equal(got["grads"][2], got["grads"][1])
        assert not matches(got["losses"][3:], losses[3:])


@marks.message
def test_under_the_default_threshold_a_large_head_stops_step_1():
    result = run_snippet(SNIPPET, 2, env={"ZERO_SETTINGS": "defaults", "VOCAB": "12800"})
    message = assert_stops(result, step=3, count=1, numel=102400)
    assert message.endswith("but got \n ()."), message
    # Step 0 trained and printed; step 1 (the first read) stopped.
    steps = [line.split(":")[0].strip() for line in result.ranks[0].stdout.splitlines() if line.startswith("  step ")]
    assert steps == ["step 0"], result.ranks[0].stdout


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 4 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
