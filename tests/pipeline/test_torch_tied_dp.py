"""snippets/pipeline/torch_tied_dp.py: the hand-kept tie of torch.distributed.pipelining on 4 ranks
(2 stages x 2 replicas) equals one process on both replicas' data."""

import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches


TORCH = "snippets/pipeline/torch_tied_dp.py"


def torch_reference():
    ex = example_namespace(TORCH)
    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    micro_batches = []
    for replica in range(2):
        tokens, targets = ex["batch"](replica)
        micro_batches += zip(tokens.tensor_split(ex["MICRO_BATCHES"]), targets.tensor_split(ex["MICRO_BATCHES"]))
    losses = []
    for _ in range(ex["STEPS"]):
        total = 0.0
        for x, y in micro_batches:
            loss = ex["cross_entropy"](model(x), y)
            (loss / len(micro_batches)).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / len(micro_batches))
    return losses, model


def test_pipelining_with_a_manual_tie_and_data_parallelism_matches_one_process(expect_output):
    result = run_snippet(TORCH, 4, call="main", timeout=300).check()
    ref_losses, model = torch_reference()
    for rank in range(4):
        got = result.returned(rank)
        assert got["stage"] == rank // 2
        assert_matches(got["losses"], ref_losses, "losses")
        assert_matches(got["weight"], model.embed.weight.detach())
        for name, value in got["parameters"].items():
            if name != "head.weight" or got["stage"] == 1:  # stage 0's head.weight is never used
                assert_matches(value, model.get_parameter(name).detach())
    print(f"{TORCH}: {result.seconds:.1f} s on 4 ranks")
    expect_output(result, output_file(TORCH))
