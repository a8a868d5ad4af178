"""snippets/transformers/peft_tied.py: LoRA with modules_to_save=["embed_tokens", "lm_head"] on a
tied Llama under Trainer + ZeRO-3. PEFT's default trains two copies that drift apart (and warns);
ensure_weight_tying=True keeps one Parameter. Each case is trained again here, in one process
without DeepSpeed (same model, seed, LoRA config, data, SGD and steps): the ZeRO-3 run's
losses, its saved adapter and its merged model's logits equal that reference's, and the
adapter merged in one process gives the trained model's logits; only the tied one stays tied."""

import os

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_adapter_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/peft_tied.py"
TIMEOUT = 600  # two Trainer runs and Transformers' import on a loaded 2-core machine
NOT_SET = "Model has `tie_word_embeddings=True` and a tied layer is part of the adapter, but `ensure_weight_tying` is not set to True."
UNTIED = "Input and output embeddings are no longer tied after merging. Setting `tie_word_embeddings=False` in the model config."
ADAPTER = "adapter_model.safetensors"


def copies(model):
    embed = model.get_input_embeddings().modules_to_save["default"].weight
    head = model.get_output_embeddings().modules_to_save["default"].weight
    return embed is head, torch.equal(embed, head)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each case in one process without DeepSpeed: the tiny Llama, seeded as the example seeds
    it before get_peft_model, trained with plain SGD on every example at once for STEPS steps
    (Trainer's step in the example: one batch of every example across the ranks)."""
    import safetensors.torch
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET, with_siblings=["tied_causal_lm"])  # its STEPS and LR too
    directory = ex["save_tiny_llama"]()
    inputs = torch.stack([row["input_ids"] for row in ex["token_dataset"]()])
    cases = {}
    for ensure in (False, True):
        model = LlamaForCausalLM.from_pretrained(directory)
        torch.manual_seed(ex["SEED"])
        model = get_peft_model(model, ex["lora_config"](ensure))
        losses = train_adapter_in_one_process(model, [inputs] * ex["STEPS"], ex["LR"])
        adapter = tmp_path_factory.mktemp(f"reference-lora-{ensure}")
        model.save_pretrained(adapter)
        one, equal = copies(model)
        with torch.no_grad():
            logits = model(input_ids=inputs).logits
            merged = model.merge_and_unload()
            merged_logits = merged(input_ids=inputs).logits
        cases[ensure] = {
            "losses": losses, "adapter": safetensors.torch.load_file(adapter / ADAPTER),
            "one parameter": one, "copies equal": equal, "logits": logits,
            "merged logits": merged_logits,
            "merged tied": merged.lm_head.weight is merged.get_input_embeddings().weight}
    return inputs, cases


@pytest.mark.parametrize("world_size", [2, 4])
def test_lora_on_tied_embeddings(world_size, reference, expect_output):
    import safetensors.torch

    inputs, want = reference
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        for ensure in (False, True):
            label = f"rank {rank}, ensure_weight_tying={ensure}"
            assert got[ensure]["error"] is None, label
            assert torch.equal(got[ensure]["inputs"], inputs)
            # Training under ZeRO-3 is the one-process training: each step's loss (Trainer's
            # mean over the ranks) and the trained model's logits.
            assert len(got[ensure]["losses"]) == len(want[ensure]["losses"]), label
            assert_matches(got[ensure]["losses"], want[ensure]["losses"], f"{label} losses")
            assert_matches(got[ensure]["logits"], want[ensure]["logits"], f"{label} logits")
        # Does training keep the two trainable copies one (and equal)? The default: no, as
        # in one process; ensure_weight_tying=True: yes.
        assert (got[False]["one parameter"], got[False]["copies equal"]) == (False, False)
        assert (want[False]["one parameter"], want[False]["copies equal"]) == (False, False)
        assert (got[True]["one parameter"], got[True]["copies equal"]) == (True, True)
        assert (want[True]["one parameter"], want[True]["copies equal"]) == (True, True)
    got = result.returned(0)
    assert any(message.startswith(NOT_SET) for message in got[False]["warned"])
    assert not any(message.startswith(NOT_SET) for message in got[True]["warned"])
    for ensure in (False, True):
        label = f"ensure_weight_tying={ensure}"
        assert "base_model.model.lm_head.weight" in got[ensure]["keys"]
        assert "base_model.model.model.embed_tokens.weight" in got[ensure]["keys"]
        # The adapter rank 0 wrote holds the one-process adapter's tensors, key for key.
        saved = safetensors.torch.load_file(os.path.join(got[ensure]["adapter"], ADAPTER))
        assert sorted(saved) == got[ensure]["keys"] == sorted(want[ensure]["adapter"])
        assert_matches(saved, want[ensure]["adapter"], f"{label} adapter")
        # Both names are in the file: one trained tensor's values with ensure_weight_tying,
        # the two copies PEFT's default trains apart without it.
        in_file = [saved[f"base_model.model.{name}.weight"]
                   for name in ("model.embed_tokens", "lm_head")]
        assert torch.equal(*in_file) is ensure, label
        # Merged in one process, the ZeRO-3 adapter gives the trained model's logits, and
        # those of the one-process adapter merged.
        assert_matches(got[ensure]["merged logits"], got[ensure]["logits"], f"{label} merged")
        assert_matches(got[ensure]["merged logits"], want[ensure]["merged logits"],
                       f"{label} merged, against one process")
        assert got[ensure]["merged tied"] is want[ensure]["merged tied"] is ensure, label
    assert UNTIED in got[False]["merge warned"] and UNTIED not in got[True]["merge warned"]
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
