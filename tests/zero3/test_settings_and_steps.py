"""snippets/zero3/settings_and_steps.py on 2 and 4 ranks: where a registered weight and a layer's
weight are whole, by step, under the examples' setting (threshold 0), with reuse and prefetch
at 0, and under DeepSpeed's defaults with an embedding of 100000 and of 100008 elements; and a
read DeepSpeed does not see (through a list): in step 0 it fails under every setting, from
step 1 it trains like plain PyTorch except with reuse and prefetch at 0."""

import pytest
import torch
import torch.nn.functional as F

from rankrun import marks
from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.results import assert_refused
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/zero3/settings_and_steps.py"
EXAMPLE = example_namespace(SNIPPET)
STEPS = EXAMPLE["STEPS"]
W, E = "whole", "(0,)"
MOMENTS = ("after deepspeed.initialize", "mixer.forward ended", "engine(...) returned",
           "engine.backward returned", "engine.step returned")

# (embeddings.weight, mixer.weight) by step at each moment, as the page states them.
THRESHOLD_0 = {
    "after deepspeed.initialize": ([E], [E]),
    "mixer.forward ended": ([W, W, W], [E, W, W]),  # the owner releases it in step 0 only
    "engine(...) returned": ([E, W, W], [E, W, W]),  # where a loss reads it: step 0 only empty
    "engine.backward returned": ([E, E, E], [E, E, E]),
    "engine.step returned": ([E, E, E], [E, E, E]),
}
LEAN = {**THRESHOLD_0,
        "mixer.forward ended": ([W, W, W], [E, E, E]),
        "engine(...) returned": ([E, E, E], [E, E, E])}
PERSISTENT = {**THRESHOLD_0,  # at most 100000 elements, default threshold: whole once step 0 ends
              "engine.backward returned": ([W, W, W], [E, W, W]),
              "engine.step returned": ([W, W, W], [W, W, W])}
ABOVE = {**PERSISTENT,  # the 100008-element embedding is partitioned as under threshold 0
         "engine.backward returned": ([E, E, E], [E, W, W]),
         "engine.step returned": ([E, E, E], [W, W, W])}
EXPECTED = {
    "threshold 0": THRESHOLD_0,
    "threshold 0, reuse 0, prefetch 0": LEAN,
    "defaults, embedding 16 x 8": PERSISTENT,
    "defaults, embedding 12500 x 8": PERSISTENT,
    "defaults, embedding 12501 x 8": ABOVE,
}
# The list read that starts in step 1 fails there only with reuse and prefetch at 0.
FAILS_FROM_STEP_1 = {"threshold 0, reuse 0, prefetch 0"}


def list_read_in_one_process(vocab, first):
    """ListRead trained in this process without DeepSpeed (plain SGD)."""
    torch.manual_seed(EXAMPLE["SEED"])
    model = EXAMPLE["ListRead"](vocab, first)
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    losses, grads = [], []
    for step in range(STEPS):
        model.step = step
        inputs, targets = EXAMPLE["make_batch"](step, vocab)
        loss = F.cross_entropy(model(inputs).reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


@marks.api
def test_the_settings_are_the_ones_named():
    settings = EXAMPLE["SETTINGS"]
    assert set(settings) == set(EXPECTED)
    for name, (vocab, zero) in settings.items():
        default = name.startswith("defaults")
        assert ("stage3_param_persistence_threshold" in zero) is not default, name
        assert default or zero["stage3_param_persistence_threshold"] == 0
    # Below, at, and above DeepSpeed's default threshold of 100000 elements.
    defaults = EXAMPLE["DeepSpeedZeroConfig"]()
    assert defaults.param_persistence_threshold == 100000
    dim = EXAMPLE["DIM"]
    assert [settings[f"defaults, embedding {v} x 8"][0] * dim for v in (16, 12500, 12501)] == [128, 100000, 100008]


@pytest.mark.parametrize("world_size", [2, 4])
def test_whole_or_empty_by_step_and_setting(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main").check()
    rows = (EXAMPLE["BATCH"] // world_size) * EXAMPLE["SEQ"]
    undetected = f"RuntimeError: size mismatch, got input ({rows}), mat ({rows}x8), vec (0)"
    references = {}
    for name, (vocab, _) in EXAMPLE["SETTINGS"].items():
        for first in (0, 1):
            if (vocab, first) not in references:
                references[vocab, first] = list_read_in_one_process(vocab, first)
    for rank in range(world_size):
        for name, (vocab, _) in EXAMPLE["SETTINGS"].items():
            got = result.returned(rank)[name]
            label = f"rank {rank}, {name}"
            for moment in MOMENTS:
                embedding, mixer = EXPECTED[name][moment]
                assert got["seen"]["embeddings.weight", moment] == embedding, (label, moment)
                assert got["seen"]["mixer.weight", moment] == mixer, (label, moment)
            # A read DeepSpeed does not see fails in step 0 under every setting and size.
            first_step = got["reads"][0]
            assert first_step["error"] == f"step 0: {undetected}", label
            assert first_step["losses"] == []
            later = got["reads"][1]
            losses, grads = references[vocab, 1]
            if name in FAILS_FROM_STEP_1:
                assert later["error"] == f"step 1: {undetected}", label
                losses, grads = losses[:1], grads[:1]  # step 0 trained before it failed
            else:
                assert later["error"] is None, label
            assert_matches(later["losses"], losses, f"{label} losses")
            assert len(later["grads"]) == len(grads)
            for step, (got_step, want_step) in enumerate(zip(later["grads"], grads)):
                assert_matches(got_step, want_step, f"{label} step {step} grads")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


@marks.refusal
def test_a_rank_count_that_does_not_split_the_batch_is_refused():
    """On 3 ranks the 8 samples split 3/3/2 and the mean of the ranks' losses is not the
    page's loss: the example says so instead of printing other numbers."""
    result = run_snippet(SNIPPET, 3, call="main")
    assert_refused(result, (
        "ValueError: 8 samples do not split evenly over 3 ranks; "
        "run on 2 or 4 ranks (the printed losses were checked on both)"))
