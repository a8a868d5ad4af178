"""snippets/pipeline/deepspeed_tied_dp.py: TiedLayerSpec on 4 ranks (2 stages x 2 replicas) equals one
process on both replicas' data."""

import torch

from rankrun.pages import output_file
from rankrun.reference import backward_over_micro_batches, example_namespace, layers_seeded_like_deepspeed
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches


DEEPSPEED = "snippets/pipeline/deepspeed_tied_dp.py"


def deepspeed_reference():
    """One process, no DeepSpeed: the layers seeded as PipelineModule(seed_layers=True) seeds
    them, one embedding as input layer and head, every step on both replicas' micro-batches
    (the loss of each divided by their number: the mean, as data parallelism averages)."""
    ex = example_namespace(DEEPSPEED)
    embedding, mixer1, mixer2 = layers_seeded_like_deepspeed(ex["SEED"], {
        0: lambda: torch.nn.Embedding(ex["VOCAB"], ex["DIM"]), 1: ex["Mixer"], 2: ex["Mixer"]})
    params = [*embedding.parameters(), *mixer1.parameters(), *mixer2.parameters()]
    optimizer = torch.optim.SGD(params, lr=ex["LR"])
    micro_batches = [mb for replica in range(2) for mb in ex["micro_batches"](replica, "cpu")]
    losses = []
    for _ in range(ex["STEPS"]):
        losses.append(backward_over_micro_batches(micro_batches, lambda tokens, targets: ex["cross_entropy"](
            ex["logits_from_embedding"](embedding, mixer2(mixer1(embedding(tokens)))), targets)))
        optimizer.step()
        optimizer.zero_grad()
    return losses, embedding.weight.detach().clone(), mixer1, mixer2


def test_deepspeed_tied_layers_with_data_parallelism_match_one_process(expect_output):
    result = run_snippet(DEEPSPEED, 4, call="main", timeout=300).check()
    ref_losses, ref_weight, mixer1, mixer2 = deepspeed_reference()
    # rank -> (stage, replica, tie group, data-parallel group): stage-major, as DeepSpeed lays it out.
    layout = {0: (0, 0, [0, 2], [0, 1]), 1: (0, 1, [1, 3], [0, 1]),
              2: (1, 0, [0, 2], [2, 3]), 3: (1, 1, [1, 3], [2, 3])}
    for rank in range(4):
        got = result.returned(rank)
        assert (got["stage"], got["replica"], got["tie_ranks"], got["dp_group"]) == layout[rank]
        assert_matches(got["losses"], ref_losses, "losses")
        # All four copies are equal after every step, and equal the one-process weight.
        assert got["differences"] == [0.0] * len(ref_losses)
        assert_matches(got["weight"], ref_weight)
        mixer = mixer1 if got["stage"] == 0 else mixer2
        layer = "1" if got["stage"] == 0 else "2"
        for name in ("weight", "bias"):
            assert_matches(got["parameters"][f"{layer}.linear.{name}"], getattr(mixer.linear, name).detach(),
                           f"stage {got['stage']} {name}")
    print(f"{DEEPSPEED}: {result.seconds:.1f} s on 4 ranks")
    expect_output(result, output_file(DEEPSPEED))
