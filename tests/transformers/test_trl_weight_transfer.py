"""snippets/transformers/trl_weight_transfer.py: TRL's unwrap_model_for_generation around a
weight transfer (the gathered state dict read, no forward in the block, as GRPOTrainer feeds
vLLM) before each of 6 micro-steps of gradient accumulation (2 per optimizer step), on 2 and 4
ranks, the helper given the model inside the engine, the engine, or the model inside after
emptying ds_active_sub_modules by hand. On the pinned releases every case transfers the
weights one process has at that micro-step, and after every backward and every step no
module still holds a weight (DeepSpeed releases them at the end of backward since 0.19.3).
On 0.16.4, 0.17.6 and 0.19.2 (the version matrix) the model-inside case fails at its second
transfer, the first after a micro-step that took no optimizer step: the tied embedding is
still held, and the block's end cannot free it."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import ROOT, run_snippet
from rankrun.tolerance import assert_matches
from versions import data

DATA = data.load_data()
SNIPPET = "snippets/transformers/trl_weight_transfer.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
EXAMPLE = example_namespace(SNIPPET)
NOTE = ROOT / "snippets/versions/trl_weight_transfer.md"
# What free_param raised at the model-inside case's second transfer, per release (version matrix).
SUMMARY = ("{'id': 0, 'status': 'AVAILABLE', 'numel': 512, 'ds_numel': 512, 'shape': (32, 16), "
           "'ds_shape': (32, 16), 'requires_grad': True, 'grad_shape': None, 'persist': False, "
           "'active_sub_modules': {2}, 'ds_tensor.shape': torch.Size([256])}")
RAISED = {
    "0.16.4": f"AssertionError: {SUMMARY}",
    "0.17.6": f"AssertionError: {SUMMARY}",
    "0.19.2": ("RuntimeError: Cannot free a ZeRO-3 parameter while it is still active in submodules. "
               "This can happen if: (1) submodules have not released the parameter, or (2) you modified "
               "parameters inside a `GatheredParameters` context with `modifier_rank=None`. For case (2), "
               "use `modifier_rank=<rank>` to broadcast updates consistently across ranks. "
               f"param={SUMMARY}"),
}


def one_process(world_size, accumulation):
    """The weights before each micro-step of the same training in one process: every rank's
    batch, the losses averaged over ranks and divided by the accumulation, one SGD step every
    `accumulation` micro-steps (what DeepSpeed does with the ranks' gradients)."""
    model = EXAMPLE["tiny_llama"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=EXAMPLE["LR"])
    weights = []
    for micro_step in range(EXAMPLE["MICRO_STEPS"]):
        weights.append({name: w.clone() for name, w in model.state_dict().items()})
        losses = [model(tokens, labels=tokens).loss
                  for tokens in (EXAMPLE["batch"](micro_step, rank) for rank in range(world_size))]
        (sum(losses) / world_size / accumulation).backward()
        if (micro_step + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
    return weights


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_transfer_reads_the_trained_weights_and_nothing_stays_held(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    want = {accumulation: one_process(world_size, accumulation) for accumulation in (1, EXAMPLE["ACCUMULATION"])}
    for rank in range(world_size):
        returned = result.returned(rank)
        assert list(returned) == list(EXAMPLE["CASES"])
        for case, record in returned.items():
            label = f"rank {rank}, {case}"
            assert record["error"] is None, (label, record["error"])
            assert len(record["transferred"]) == EXAMPLE["MICRO_STEPS"], label
            # DeepSpeed 0.19.8 releases what a module held at the end of every backward
            assert record["held_after_backward"] == [[]] * EXAMPLE["MICRO_STEPS"], label
            assert record["held_after_step"] == [[]] * EXAMPLE["MICRO_STEPS"], label
            accumulation = EXAMPLE["CASES"][case].get("accumulation", EXAMPLE["ACCUMULATION"])
            for micro_step, weights in enumerate(record["transferred"]):
                assert_matches(weights, want[accumulation][micro_step], f"{label}, transfer {micro_step}")
    # with accumulation, the weights change between optimizer steps, not within one
    accumulated = want[EXAMPLE["ACCUMULATION"]]
    assert not torch.equal(accumulated[0]["lm_head.weight"], accumulated[2]["lm_head.weight"])
    assert torch.equal(accumulated[0]["lm_head.weight"], accumulated[1]["lm_head.weight"])
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


def test_the_version_matrix_shows_the_second_transfer_failing_before_0_19_3():
    """What the example printed on the other releases (versions/matrix.json), which the page
    includes as the example's note: before 0.19.3 the embedding stays held through a micro-step
    without an optimizer step, and the model-inside case stops at its second transfer with
    free_param's check; the three other ways of giving the helper its model transfer six times."""
    command = f"torchrun --nproc_per_node 2 {SNIPPET}"
    steps = EXAMPLE["MICRO_STEPS"]
    for release in (*RAISED, "0.19.3"):
        printed = DATA["releases"][release]["examples"][command]["printed"][0]
        for case in EXAMPLE["CASES"]:
            want = (f"1 of {steps} weight transfers, then {RAISED[release]}"
                    if case == "engine.module" and release in RAISED else f"{steps} of {steps} weight transfers")
            assert f"unwrap_model_for_generation({case}): {want}\n" in printed, (release, case)
        held = "['model.embed_tokens.weight']" if release in RAISED else "[]"
        assert f"micro-step 0's backward: {held}, after its step: {held}\n" in printed, release
        assert f"micro-step 1's backward: {held}, after its step: []\n" in printed, release
    note = NOTE.read_text()
    assert all(release in note for release in (*RAISED, "0.19.3"))
