"""snippets/pipeline/hf_pipeline_loader_tied.py: the tied checkpoint holds no lm_head.weight; with
TiedLayerSpec on the embedding's key the pipeline keeps one weight and trains like the Hugging
Face model in one process, on 2 and 4 ranks (2 and 4 stages); a head copied from the embedding
trains two weights, like the untied model in one process."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/hf_pipeline_loader_tied.py"


def train_hf_in_one_process(tied=True):
    """The saved model, built again as the snippet builds it (its config, its seed), trained in
    one process with SGD on the same micro-batches, each loss divided by their number. With
    tied=False, lm_head is a copy of the embedding: the untied model the copied head trains."""
    ex = example_namespace(SNIPPET, with_siblings=["hf_pipeline_loader"])
    from transformers import LlamaForCausalLM
    torch.manual_seed(ex["SEED"])
    model = LlamaForCausalLM(ex["tiny_llama_config"]())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    losses = []
    for _ in range(ex["STEPS"]):
        batches = list(ex["micro_batches"]("cpu"))
        total = 0.0
        for tokens, targets in batches:
            loss = ex["cross_entropy"](model(input_ids=tokens).logits, targets)
            (loss / len(batches)).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / len(batches))
    return losses, model.model.embed_tokens.weight.detach().clone(), model.lm_head.weight.detach().clone()


@pytest.fixture(scope="module")
def references():
    return train_hf_in_one_process(), train_hf_in_one_process(tied=False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tied_layer_spec_trains_the_hf_model_and_a_copied_head_two_weights(world_size, references,
                                                                          expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=600).check()
    (tied_losses, tied_weight, _), (untied_losses, untied_embed, untied_head) = references
    for rank in range(world_size):
        got = result.returned(rank)
        # save_pretrained stored the tied weight once, under the embedding's name.
        assert "lm_head.weight" not in got["keys"] and "model.embed_tokens.weight" in got["keys"]
        tied, copied = got["results"]["TiedLayerSpec"], got["results"]["copied head"]
        # TiedLayerSpec: the first and the last stage hold the same weight, bit for bit, when
        # loaded and after every step; losses and the weight equal the HF model in one process.
        assert tied["gaps"] == [0.0] * (len(tied_losses) + 1)
        assert_matches(tied["losses"], tied_losses, f"rank {rank} tied losses")
        assert_matches(tied["first"], tied_weight, f"rank {rank} tied weight")
        # The copied head: equal when loaded, the same first loss, then two weights apart.
        assert copied["gaps"][0] == 0.0
        assert all(gap > 1e-2 for gap in copied["gaps"][1:]), copied["gaps"]
        assert_matches(copied["losses"][0], tied_losses[0], "copied head, step 0")
        assert not matches(copied["losses"], tied_losses)
        assert not matches(copied["first"], tied_weight)
        # What it trains is the untied model: embedding and head updated each by its own use.
        assert_matches(copied["losses"], untied_losses, f"rank {rank} copied losses")
        assert_matches(copied["first"], untied_embed, f"rank {rank} copied embedding")
        assert_matches(copied["last"], untied_head, f"rank {rank} copied head")
    # The loss the snippet prints for the HF model is the one-process step 0.
    assert f"Hugging Face model, one process, step 0: loss {tied_losses[0]:.4f}" in result.output
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
