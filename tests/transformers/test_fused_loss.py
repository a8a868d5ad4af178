"""snippets/transformers/fused_loss.py: a fused linear + cross-entropy Function under ZeRO-3,
both kinds (the weight's gradient computed in forward, or in backward), in six placements.
It trains like plain PyTorch (losses and every full gradient, three steps) exactly where a
running forward read the weight or the backward ran inside the GatheredParameters block, and
fails with the readers' messages everywhere else, whichever kind."""

import pytest
import torch
import torch.nn.functional as F

from rankrun.pages import output_file
from rankrun.reference import assert_same_training, example_namespace, train_in_one_process
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/fused_loss.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
EXAMPLE = example_namespace(SNIPPET)
KINDS = EXAMPLE["KINDS"]

SIZE_MISMATCH = "RuntimeError: size mismatch, got input (4), mat (4x16), vec (0)"
ACCUMULATE = ("RuntimeError: The size of tensor a (0) must match the size of tensor b (16) "
              "at non-singleton dimension 1")
TRAINS = {"weight read in the model's forward", "gathered in the loop, backward inside the block",
          "run as the engine's forward (TRL)"}
# Where it does not train: forward fails without the weight; backward after the block fails
# in the weight's gradient (kind 1) or in the values the backward reads (kind 2).
FAILS = {
    ("gradient in forward", "weight passed from the training loop"): SIZE_MISMATCH,
    ("gradient in forward", "gathered in the loop, backward after the block"): ACCUMULATE,
    ("gradient in forward", "run as the engine's forward, after a call of the whole model"): ACCUMULATE,
    ("gradient in backward", "weight passed from the training loop"): SIZE_MISMATCH,
    ("gradient in backward", "gathered in the loop, backward after the block"): SIZE_MISMATCH,
    ("gradient in backward", "run as the engine's forward, after a call of the whole model"): SIZE_MISMATCH,
}


@pytest.fixture(scope="module")
def reference():
    """The same Llama and batches in this one process with plain SGD, the loss unfused: every
    token's logits (FusedLossLlama without labels returns the hidden states), then
    cross-entropy."""
    model = EXAMPLE["tiny_llama"]()
    batches = [(EXAMPLE["batch"](step),) * 2 for step in range(EXAMPLE["STEPS"])]

    def unfused(hidden, tokens):
        return F.cross_entropy(model.lm_head(hidden), tokens[:, 1:].reshape(-1))
    return train_in_one_process(model, batches, unfused, EXAMPLE["LR"])


@pytest.mark.parametrize("kind", list(KINDS))
def test_both_kinds_give_the_unfused_gradients_in_one_process(kind):
    """Without DeepSpeed, each Function's loss and gradients are autograd's for the unfused loss
    (on a batch that CHUNK does not divide, so a short last chunk is covered)."""
    torch.manual_seed(1)
    hidden = torch.randn(7, EXAMPLE["HIDDEN"], requires_grad=True)
    weight = torch.randn(EXAMPLE["VOCAB"], EXAMPLE["HIDDEN"], requires_grad=True)
    labels = torch.randint(0, EXAMPLE["VOCAB"], (7,))
    want = F.cross_entropy(hidden @ weight.t(), labels)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    got = KINDS[kind].apply(hidden, weight, labels)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    assert_matches([got.item()], [want.item()], f"{kind} loss")
    for name, g, w in zip(("hidden", "weight"), got_grads, want_grads):
        assert_matches(g, w, f"{kind} {name} grad")


def test_a_gradient_for_an_emptied_weight_is_autogrades_message():
    """The backward message of the gradient-in-forward kind is autograd's own: it stores a
    weight's gradient in the weight's shape at that moment, and the block left it empty (0,).
    Shown here without DeepSpeed: the same message for a plain Parameter emptied by hand."""
    hidden = torch.randn(4, EXAMPLE["HIDDEN"])
    weight = torch.nn.Parameter(torch.randn(EXAMPLE["VOCAB"], EXAMPLE["HIDDEN"]))
    loss = EXAMPLE["GradientInForward"].apply(hidden, weight, torch.zeros(4, dtype=torch.long))
    weight.data = torch.empty(0)  # what the end of a GatheredParameters block does
    with pytest.raises(RuntimeError) as raised:
        loss.backward()
    assert f"RuntimeError: {raised.value}" == ACCUMULATE


@pytest.mark.parametrize("tokens, width, vocab", [(3, 5, 7), (9, 16, 32), (1, 64, 3)])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_rule_on_other_shapes_without_deepspeed(kind, tokens, width, vocab):
    """The rule of the page on shapes not written for it, with the block's exit done by hand:
    once the weight is emptied after the forward, a trainable weight fails in backward, either
    kind (the gradient-in-forward kind with autograd's message naming the width). A frozen
    weight with hidden states that need a gradient: the kind that computed that gradient in
    forward needs nothing of the weight and trains; the other kind needs its values and fails."""
    example = example_namespace(SNIPPET)
    function = example["KINDS"][kind]
    function.forward.__globals__["VOCAB"] = vocab  # a fresh namespace: the Functions read it
    torch.manual_seed(tokens)
    labels = torch.randint(0, vocab, (tokens,))
    for trainable in (True, False):
        hidden = torch.randn(tokens, width, requires_grad=not trainable)
        weight = torch.nn.Parameter(torch.randn(vocab, width), requires_grad=trainable)
        full = weight.detach().clone()
        loss = function.apply(hidden, weight, labels)
        weight.data = torch.empty(0)
        if trainable:
            with pytest.raises(RuntimeError) as raised:
                loss.backward()
            if kind == "gradient in forward":
                assert f"must match the size of tensor b ({width})" in str(raised.value)
        elif kind == "gradient in forward":  # nothing of the weight is needed: it trains
            loss.backward()
            want = torch.autograd.grad(
                F.cross_entropy(hidden @ full.t(), labels), hidden)[0]
            assert_matches(hidden.grad, want, f"{kind} hidden grad")
        else:  # the gradient of the hidden states needs the weight's values
            with pytest.raises(RuntimeError):
                loss.backward()


@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_loss_trains_only_where_a_forward_or_the_block_holds_the_weight(
        world_size, reference, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert set(got) == {(kind, placement) for kind in KINDS for placement in EXAMPLE["PLACEMENTS"]}
        for (kind, placement), record in got.items():
            label = f"rank {rank}, {kind}, {placement}"
            if placement in TRAINS:
                assert record["error"] is None, (label, record["error"])
                assert_same_training(record, reference, label)
            else:
                assert record["error"] == FAILS[kind, placement], (label, record["error"])
                assert record["losses"] == [], label  # the first step already failed
            # TRL's helper gathers only where DeepSpeed had not: after the nested call
            nested = placement == "run as the engine's forward, after a call of the whole model"
            assert record["gathered by TRL"] is nested, label
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    result = run_snippet(SNIPPET, 3, call="main", timeout=TIMEOUT)
    assert_refused(result, (
        "ValueError: 4 sequences do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
