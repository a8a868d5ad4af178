"""snippets/transformers/convert_tied_megatron.py: a tied Llama's checkpoint converted to Megatron
Core's GPTModel and back with a key mapping, on one CPU process. The naive mapping's KeyError, the
tied mapping's strict load, Megatron's output layer and converted layers against the Hugging Face
model built here, a file with both names refused by the tied GPTModel, the way back reloaded
tied with the original's logits, a strict load_state_dict and a weight sync that fail on the
missing or extra name, and what from_pretrained makes of each file a converter may write."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/transformers/convert_tied_megatron.py"
TIMEOUT = 300  # Transformers' and Megatron Core's imports, nine from_pretrained, on a loaded machine
UNEXPECTED = ('RuntimeError: Error(s) in loading state_dict for GPTModel:\n'
              '\tUnexpected key(s) in state_dict: "output_layer.weight". ')
MISSING = ('RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM:\n'
           '\tMissing key(s) in state_dict: "lm_head.weight". ')
UNTIED = ("The tied weights mapping and config for this model specifies to tie "
          "model.embed_tokens.weight to lm_head.weight, but both are present in the checkpoints "
          "with different values, so we will NOT tie them. You should update the config with "
          "`tie_word_embeddings=False` to silence this warning.")
NEW_HEAD = "lm_head.weight | MISSING"
NEW_EMBEDDING = "model.embed_tokens.weight | MISSING"


@pytest.fixture(scope="module")
def run():
    return run_snippet(SNIPPET, 1, call="main", timeout=TIMEOUT).check()


@pytest.fixture(scope="module")
def original():
    """The tiny tied Llama the example converts, built again in this process, and its logits."""
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET)
    torch.manual_seed(ex["SEED"])
    model = LlamaForCausalLM(ex["tiny_llama_config"](tie=True))
    tokens = torch.randint(0, ex["VOCAB"], (2, ex["SEQ"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model, tokens, model(tokens).logits


def test_hugging_face_to_megatron(run, original, expect_output):
    got = run.returned(0)
    model, _, _ = original
    # save_pretrained wrote the tied weight once, under the embedding's name.
    assert "model.embed_tokens.weight" in got["file keys"] and "lm_head.weight" not in got["file keys"]
    # A mapping that names lm_head.weight fails on that file.
    assert got["naive"] == "KeyError: 'lm_head.weight'"
    # The tied mapping loads strictly into GPTModel(share_embeddings_and_output_weights=True),
    # whose output layer has no weight of its own (Megatron-Bridge #1420's "'weight': None").
    assert got["loaded"] == "<All keys matched successfully>"
    assert got["output_layer.weight"] is None
    assert "output_layer.weight" not in got["megatron keys"]
    assert "embedding.word_embeddings.weight" in got["megatron keys"]
    # Megatron's embedding and output layer give Hugging Face's numbers, and so does the
    # output layer with a weight of its own, copied from the embedding (a separate tensor).
    want_embeddings = got["embeddings"][1]
    assert_matches(want_embeddings, model.model.embed_tokens(original[1]).detach(), "HF embeddings")
    assert_matches(*got["embeddings"], "Megatron embeddings")
    assert_matches(*got["logits, shared head"], "logits, shared head")
    assert_matches(*got["logits, own head"], "logits, own head")
    assert got["own head is a copy"]
    # The converted layers compute what the Hugging Face layers do: norms, the fused Q/K/V
    # (Megatron's group order), the gated MLP from the concatenated gate and up.
    for layer, outputs in enumerate(got["layers"]):
        for name, (megatron, hf) in outputs.items():
            assert_matches(megatron, hf, f"layer {layer} {name}")
        # a check that could fail: queries and keys of a layer are different numbers
        assert not matches(outputs["q"][0][..., :8], outputs["k"][0])
    # The whole GPTModel's forward needs CUDA in megatron-core 0.16.1 (RoPE's inv_freq).
    assert got["forward"] == "AssertionError: Torch not compiled with CUDA enabled"
    # A file that also holds lm_head.weight: mapped to output_layer.weight, which the tied
    # GPTModel does not have; the tied mapping drops it when it equals the embedding, and
    # refuses a different one.
    assert got["unexpected"] == UNEXPECTED
    assert got["both names fixed"] == "<All keys matched successfully>"
    assert got["differs"] == ("ValueError: tie_word_embeddings=True, but lm_head.weight differs from "
                              "the embedding: set tie_word_embeddings=False and map it")
    # With a config that does not tie, the same file converts: its own head, not the embedding.
    assert got["untied error"] is None
    untied = got["untied"]
    assert torch.equal(untied["output_layer.weight"], 2 * model.model.embed_tokens.weight.detach())
    assert torch.equal(untied["embedding.word_embeddings.weight"], model.model.embed_tokens.weight.detach())
    expect_output(run, output_file(SNIPPET))


def test_megatron_to_hugging_face(run, original):
    got = run.returned(0)
    _, _, logits = original
    # The tied GPTModel's state dict mapped back has no lm_head.weight ...
    assert "lm_head.weight" not in got["converted keys"]
    assert "model.embed_tokens.weight" in got["converted keys"]
    # ... and from_pretrained ties it again: the original's logits.
    assert got["round trip tied"] is True
    assert_matches(got["round trip logits"][0], logits, "from_pretrained after the round trip")
    assert_matches(*got["round trip logits"], "the run's own original")
    # A strict load_state_dict asks for the name; given it, the model keeps its tie.
    assert got["missing"] == MISSING
    assert got["load_state_dict tied"] is True
    assert_matches(got["load_state_dict logits"][0], logits, "load_state_dict with both names")
    # Copying by named_parameters() meets lm_head.weight, which a tied model lists under the
    # embedding's name only; skipping it keeps the tie and the original's logits.
    assert got["sync"] == "KeyError: 'lm_head.weight'"
    assert got["sync tied"] is True
    assert_matches(got["sync logits"][0], logits, "after sync_weights_tied")


def test_what_from_pretrained_makes_of_each_file(run):
    rows = {(row["file"], row["config ties"]): row for row in run.returned(0)["variants"]}
    both = "model.embed_tokens.weight = lm_head.weight"
    expected = {  # (tied, where lm_head.weight came from, where the embedding came from)
        ("embedding only", True): (True, "model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("embedding only", False): (False, "new", "model.embed_tokens.weight"),
        ("both, equal", True): (True, both, both),
        ("both, equal", False): (False, both, both),
        ("both, different", True): (False, "lm_head.weight", "model.embed_tokens.weight"),
        ("both, different", False): (False, "lm_head.weight", "model.embed_tokens.weight"),
        ("head only", True): (True, "lm_head.weight", "lm_head.weight"),
        ("head only", False): (False, "lm_head.weight", "new"),
    }
    assert set(rows) == set(expected)
    for key, (tied, head, embedding) in expected.items():
        assert (rows[key]["tied"], rows[key]["head"], rows[key]["embedding"]) == (tied, head, embedding), key
    # What Transformers logs: the warning for two different tensors and a config that ties,
    # its load report for a missing tensor and a config that does not; nothing otherwise.
    logged = {key: " ".join(row["logged"]) for key, row in rows.items()}
    assert logged.pop(("both, different", True)) == UNTIED
    assert NEW_HEAD in logged.pop(("embedding only", False))
    assert NEW_EMBEDDING in logged.pop(("head only", False))
    assert set(logged.values()) == {""}
