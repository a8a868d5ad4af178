"""snippets/transformers/peft_modules_to_save.py on the pinned stack: LoRA with
modules_to_save=["lm_head"], and with the tied embedding as well, trains under ZeRO-3 as it
trains in one process without DeepSpeed (same seed, LoRA config, data, SGD and steps); the
adapter save_model writes holds the whole trained tensors, and loaded in one process it gives
the trained model's logits. The errors of other releases are the version matrix's
(versions/releases.toml; the note snippets/versions/peft_modules_to_save.md)."""

import os

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_adapter_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/peft_modules_to_save.py"
TIMEOUT = 600  # two Trainer runs and Transformers' import on a loaded 2-core machine


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    import safetensors.torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET, with_siblings=["tied_causal_lm"])
    directory = ex["save_tiny_llama"]()
    inputs = torch.stack([row["input_ids"] for row in ex["token_dataset"]()])
    cases = {}
    for name, modules in ex["CASES"].items():
        model = LlamaForCausalLM.from_pretrained(directory)
        torch.manual_seed(ex["SEED"])
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, modules_to_save=modules,
                                                 target_modules=["q_proj", "v_proj"]))
        losses = train_adapter_in_one_process(model, [inputs] * ex["STEPS"], ex["LR"])
        folder = tmp_path_factory.mktemp("reference-lora")
        model.save_pretrained(folder)
        with torch.no_grad():
            logits = model(input_ids=inputs).logits
        saved = safetensors.torch.load_file(folder / "adapter_model.safetensors")
        cases[name] = {"losses": losses, "logits": logits, "adapter": saved}
    return inputs, cases


def test_modules_to_save_trains_saves_and_loads_on_the_pinned_stack(reference, expect_output):
    import safetensors.torch

    inputs, want = reference
    result = run_snippet(SNIPPET, 2, call="main", timeout=TIMEOUT).check()
    for rank in range(2):
        got = result.returned(rank)
        for name in want:
            label = f"rank {rank}, {name}"
            assert got[name]["error"] is None, label
            assert torch.equal(got[name]["inputs"], inputs)
            assert_matches(got[name]["losses"], want[name]["losses"], f"{label} losses")
            assert_matches(got[name]["logits"], want[name]["logits"], f"{label} logits")
    got = result.returned(0)
    for name in want:
        saved = safetensors.torch.load_file(
            os.path.join(got[name]["adapter"], "adapter_model.safetensors"))
        # Every tensor whole (none of size 0), equal to the one-process adapter's.
        assert sorted(saved) == sorted(want[name]["adapter"]), name
        assert_matches(saved, want[name]["adapter"], f"{name} adapter")
        assert got[name]["load error"] is None, name
        assert_matches(got[name]["loaded"], got[name]["logits"], f"{name} loaded")
    assert sorted(k for k in got["head"]["shapes"] if "lora" not in k) == [
        "base_model.model.lm_head.weight"]
    expect_output(result, output_file(SNIPPET))
