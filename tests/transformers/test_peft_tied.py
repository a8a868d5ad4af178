"""snippets/transformers/peft_tied.py: LoRA with modules_to_save=["embed_tokens", "lm_head"] on a
tied Llama under Trainer + ZeRO-3. PEFT's default trains two copies that drift apart (and warns);
ensure_weight_tying=True keeps one Parameter. Either way the adapter merged in one process
without DeepSpeed gives the trained model's logits; only the tied one stays tied."""

import pytest

from rankrun.pages import output_file
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/peft_tied.py"
TIMEOUT = 600  # two Trainer runs and Transformers' import on a loaded 2-core machine
NOT_SET = "Model has `tie_word_embeddings=True` and a tied layer is part of the adapter, but `ensure_weight_tying` is not set to True."
UNTIED = "Input and output embeddings are no longer tied after merging. Setting `tie_word_embeddings=False` in the model config."


@pytest.mark.parametrize("world_size", [2, 4])
def test_lora_on_tied_embeddings(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got[False]["error"] is None and got[True]["error"] is None
        assert (got[False]["one parameter"], got[False]["copies equal"]) == (False, False)
        assert (got[True]["one parameter"], got[True]["copies equal"]) == (True, True)
        assert_matches(got[True]["logits"], result.returned(0)[True]["logits"], f"rank {rank} logits")
    got = result.returned(0)
    assert any(message.startswith(NOT_SET) for message in got[False]["warned"])
    assert not any(message.startswith(NOT_SET) for message in got[True]["warned"])
    for ensure in (False, True):
        assert "base_model.model.lm_head.weight" in got[ensure]["keys"]
        assert "base_model.model.model.embed_tokens.weight" in got[ensure]["keys"]
        assert_matches(got[ensure]["merged logits"], got[ensure]["logits"], f"merged, ensure={ensure}")
    assert got[False]["merged tied"] is False and UNTIED in got[False]["merge warned"]
    assert got[True]["merged tied"] is True and UNTIED not in got[True]["merge warned"]
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
