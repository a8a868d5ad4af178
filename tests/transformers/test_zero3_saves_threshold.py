"""snippets/transformers/zero3_saves_threshold.py: at DeepSpeed's default
stage3_param_persistence_threshold, a plain save on rank 0 of a model trained under ZeRO-3 writes
size 0 for exactly the tensors over the threshold (the full model's MLP matrices; the adapter's
lora_B, not its lora_A), and every other tensor whole, with the values of the same training done
in one process without DeepSpeed; loading each file in one process raises the exact message."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_adapter_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/zero3_saves_threshold.py"
TIMEOUT = 600  # two Trainer runs and Transformers' import on a loaded 2-core machine
IGNORED = ("RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error. "
           "For details look at the above report!")


@pytest.fixture(scope="module")
def reference():
    """The wide tied Llama and its adapter trained in one process with plain SGD on every
    example at once, STEPS steps (what one Trainer step over the ranks does)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET, with_siblings=["tied_causal_lm"])
    directory = ex["save_wide_llama"]()
    inputs = torch.stack([row["input_ids"] for row in ex["token_dataset"]()])
    full = LlamaForCausalLM.from_pretrained(directory)
    train_adapter_in_one_process(full, [inputs] * ex["STEPS"], ex["LR"])  # every weight trains
    base = LlamaForCausalLM.from_pretrained(directory)
    torch.manual_seed(ex["SEED"])
    adapter = get_peft_model(base, LoraConfig(**ex["LORA"]))
    train_adapter_in_one_process(adapter, [inputs] * ex["STEPS"], ex["LR"])
    return {"threshold": ex["THRESHOLD"], "intermediate": ex["INTERMEDIATE"],
            "full model": {k: v.detach() for k, v in full.state_dict().items()},
            "adapter": {k: v.detach() for k, v in get_peft_model_state_dict(adapter).items()}}


def test_a_plain_save_empties_exactly_the_tensors_over_the_threshold(reference, expect_output):
    result = run_snippet(SNIPPET, 2, call="main", timeout=TIMEOUT).check()
    got = result.returned(0)
    threshold = reference["threshold"]
    for case in ("full model", "adapter"):
        tensors, shapes = got[case]["tensors"], got[case]["shapes"]
        over = sorted(key for key in tensors if torch.Size(shapes[key]).numel() > threshold)
        empty = sorted(key for key, t in tensors.items() if t.numel() == 0)
        assert empty == over and over, (case, empty, over)
        # Every tensor at or under the threshold is whole, with the one-process training's values.
        whole = {key: t for key, t in tensors.items() if key not in over}
        assert whole and all(tuple(t.shape) == shapes[key] for key, t in whole.items())
        assert_matches(whole, {key: reference[case][key] for key in whole}, case)
    assert [key.split(".")[-2] for key in sorted(got["adapter"]["tensors"])] == ["lora_A", "lora_B"]
    assert got["full model"]["load error"] == IGNORED
    assert got["adapter"]["load error"] == (
        "RuntimeError: Error(s) in loading state_dict for PeftModel: size mismatch for "
        "base_model.model.model.layers.0.mlp.gate_proj.lora_B.default.weight: copying a param "
        "with shape torch.Size([0]) from checkpoint, the shape in current model is "
        f"torch.Size([{reference['intermediate']}, 16]).")
    expect_output(result, output_file(SNIPPET))
