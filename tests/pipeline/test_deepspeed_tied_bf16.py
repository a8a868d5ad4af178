"""snippets/pipeline/deepspeed_tied_bf16.py: TiedLayerSpec with ZeRO-1, bf16 and both, on 2 stages
x 2 replicas: the copies stay bit-identical and training equals one fp32 process (bf16 within
the bf16 tolerance)."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, layers_seeded_like_deepspeed
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, deviation

SNIPPET = "snippets/pipeline/deepspeed_tied_bf16.py"
# rank -> (stage, replica, tie group): stage-major, as DeepSpeed lays 4 ranks out.
LAYOUT = {0: (0, 0, [0, 2]), 1: (0, 1, [1, 3]), 2: (1, 0, [0, 2]), 3: (1, 1, [1, 3])}
OPTIMIZERS = {"ZeRO-1": "DeepSpeedZeroOptimizer", "bf16": "BF16_Optimizer",
              "bf16 + ZeRO-1": "DeepSpeedZeroOptimizer"}


def train_in_one_process(scale_by_micro_batches=True):
    """fp32, one process, both replicas' micro-batches each step. The gradient is the mean over
    them (what data parallelism and gradient accumulation should give), or, for contrast, their
    sum (a pipeline that forgot to divide by the number of micro-batches)."""
    ex = example_namespace(SNIPPET)
    embedding, mixer1, mixer2 = layers_seeded_like_deepspeed(ex["SEED"], {
        0: lambda: torch.nn.Embedding(ex["VOCAB"], ex["DIM"]), 1: ex["Mixer"], 2: ex["Mixer"]})
    params = [*embedding.parameters(), *mixer1.parameters(), *mixer2.parameters()]
    optimizer = torch.optim.SGD(params, lr=ex["LR"])
    micro_batches = [mb for replica in range(2) for mb in ex["micro_batches"](replica, "cpu")]
    divide = len(micro_batches) if scale_by_micro_batches else 1
    losses, weights = [], []
    for _ in range(ex["STEPS"]):
        total = 0.0
        for tokens, targets in micro_batches:
            logits = ex["logits_from_embedding"](embedding, mixer2(mixer1(embedding(tokens))))
            loss = ex["cross_entropy"](logits, targets)
            (loss / divide).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / len(micro_batches))
        weights.append(embedding.weight.detach().clone())
    return losses, weights


@pytest.fixture(scope="module")
def run():
    return run_snippet(SNIPPET, 4, call="main", timeout=600).check()


def test_zero1_and_bf16_keep_the_tie_and_train_like_one_process(run, expect_output):
    ref_losses, ref_weights = train_in_one_process()
    for rank in range(4):
        for name, got in run.returned(rank).items():
            label = f"rank {rank} {name}"
            assert (got["stage"], got["replica"], got["tie_ranks"]) == LAYOUT[rank], label
            assert got["optimizer"] == OPTIMIZERS[name], label
            assert got["dtype"] == ("torch.float32" if name == "ZeRO-1" else "torch.bfloat16")
            # All four copies, of the weight forward uses and of the fp32 master the optimizer
            # updates, bit-identical after every step.
            assert got["differences"] == [(0.0, 0.0)] * len(ref_losses), label
            dtype = torch.float32 if name == "ZeRO-1" else torch.bfloat16
            assert_matches(got["losses"], ref_losses, f"{label} losses", dtype=dtype)
            assert_matches(got["masters"], ref_weights, f"{label} fp32 master", dtype=dtype)
    expect_output(run, output_file(SNIPPET))


def test_bf16_is_in_effect_and_closer_to_the_mean_than_to_a_scaling_error(run):
    ref_losses, ref_weights = train_in_one_process()
    _, summed_weights = train_in_one_process(scale_by_micro_batches=False)
    results = run.returned(0)
    fp32 = results["ZeRO-1"]
    for name in ("bf16", "bf16 + ZeRO-1"):
        got = results[name]
        # bf16 rounds: the losses are not those of the fp32 run.
        assert got["losses"] != fp32["losses"], name
        # The bf16 tolerance is wide (16 bf16 eps of the largest value); this says the run
        # follows the correctly scaled gradient, not one off by the number of micro-batches.
        right = deviation(got["masters"], ref_weights, torch.bfloat16)
        wrong = deviation(got["masters"], summed_weights, torch.bfloat16)
        assert right * 4 < wrong, (name, right, wrong)
    # bf16 with and without ZeRO-1: the same numbers here.
    assert results["bf16"]["losses"] == results["bf16 + ZeRO-1"]["losses"]
