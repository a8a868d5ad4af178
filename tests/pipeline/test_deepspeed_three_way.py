"""snippets/pipeline/deepspeed_three_way.py: one TiedLayerSpec key used three times is one tie group of
three stages, equal to one process."""

import torch

from rankrun.pages import output_file
from rankrun.reference import backward_over_micro_batches, example_namespace, layers_seeded_like_deepspeed
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches


DEEPSPEED = "snippets/pipeline/deepspeed_three_way.py"


def deepspeed_reference():
    """One process: layers seeded as PipelineModule(seed_layers=True) seeds them (layer i after
    manual_seed(SEED + i); the tied module is built at its first use, layer 0), one embedding
    for the three uses, the same micro-batches and SGD."""
    ex = example_namespace(DEEPSPEED)
    embedding, encoder, decoder = layers_seeded_like_deepspeed(ex["SEED"], {
        0: lambda: torch.nn.Embedding(ex["VOCAB"], ex["DIM"]), 1: ex["Mixer"], 3: ex["Mixer"]})
    params = [*embedding.parameters(), *encoder.parameters(), *decoder.parameters()]
    optimizer = torch.optim.SGD(params, lr=ex["LR"])
    losses = []
    for _ in range(ex["STEPS"]):
        def loss_of(inputs, targets):
            out = ex["embed_source"](embedding, inputs)
            out = ex["embed_target"](embedding, encoder(out))
            return ex["cross_entropy"](ex["logits"](embedding, decoder(out)), targets)

        losses.append(backward_over_micro_batches(ex["micro_batches"]("cpu"), loss_of))
        optimizer.step()
        optimizer.zero_grad()
    return losses, embedding.weight.detach().clone()


def test_deepspeed_one_key_three_uses_is_one_tie_group_of_three_stages(expect_output):
    result = run_snippet(DEEPSPEED, 3, call="main", timeout=300).check()
    ref_losses, ref_weight = deepspeed_reference()
    for rank in range(3):
        got = result.returned(rank)
        # One tied module per stage, one group of all three stages.
        assert got["tied_modules"] == ["embed"]
        assert got["tie_ranks"] == [0, 1, 2]
        assert_matches(got["losses"], ref_losses, "losses")
        assert_matches(got["weight"], ref_weight)
    print(f"{DEEPSPEED}: {result.seconds:.1f} s on 3 ranks")
    expect_output(result, output_file(DEEPSPEED))
