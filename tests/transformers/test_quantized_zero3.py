"""snippets/transformers/quantized_zero3.py: a bitsandbytes model under ZeRO-3. Transformers
refuses a device_map with the exact message; a 4-bit or 8-bit layer built inside zero.Init
quantizes its empty partition and fails with the exact errors; the QLoRA path (ZeRO-3 config
alive, from_pretrained without device_map, LoRA, Trainer) loads the model whole on every rank
(no parameter has a ds_numel), then deepspeed.initialize partitions every parameter, the
quantized ones in their storage dtype, and the training equals the same training in one process
without DeepSpeed, for 4-bit with uint8 and float32 storage and for 8-bit."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_adapter_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/quantized_zero3.py"
TIMEOUT = 600  # three Trainer runs on a loaded 2-core machine
DEVICE_MAP = "ValueError: DeepSpeed Zero-3 is not compatible with passing a `device_map`."
FOUR_BIT = "ValueError: matmul_4bit: quant_state.shape must be 2D [N, K]"
EIGHT_BIT = "ZeroDivisionError: integer division or modulo by zero"
STORAGE = {"4-bit NF4": ("Params4bit", "uint8", 1), "4-bit NF4, float32 storage":
           ("Params4bit", "float32", 4), "8-bit": ("Int8Params", "int8", None)}


@pytest.fixture(scope="module")
def reference():
    """Each quantized model in one process without DeepSpeed, with the LoRA adapter seeded as
    the example seeds it, trained with plain SGD on every example at once for STEPS steps
    (Trainer's step in the example), in training mode as Trainer trains."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET, with_siblings=["tied_causal_lm"])
    directory = ex["save_tiny_llama"]()
    inputs = torch.stack([row["input_ids"] for row in ex["token_dataset"]()])
    want = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, quantization in ex["QUANTIZATIONS"].items():
            model = LlamaForCausalLM.from_pretrained(
                directory, quantization_config=quantization, dtype=torch.float32)
            full = {n: (p.numel(), type(p).__name__) for n, p in model.named_parameters()}
            torch.manual_seed(ex["SEED"])
            model = get_peft_model(model, LoraConfig(**ex["LORA"]))
            model.train()
            train_adapter_in_one_process(model, [inputs] * ex["STEPS"], ex["LR"])
            with torch.no_grad():
                logits = model(input_ids=inputs).logits
            weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            want[name] = {"weights": weights, "logits": logits, "loaded": full}
    return want


@pytest.mark.parametrize("world_size", [2, 4])
def test_refusals_and_the_qlora_path(world_size, reference, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["device_map"] == DEVICE_MAP
        assert got["zero.Init"]["4-bit"]["error"] == FOUR_BIT
        assert got["zero.Init"]["8-bit"]["error"] == EIGHT_BIT
        # zero.Init partitioned the float weight before bitsandbytes quantized it: it
        # quantized the empty partition (shape (0, 1)) and keeps the full shape only in ds_shape.
        assert got["zero.Init"]["4-bit"]["built"]["shape"] == (0,)
        assert got["zero.Init"]["4-bit"]["moved"]["shape"] == (0, 1)
        assert got["zero.Init"]["4-bit"]["moved"]["dtype"] == "uint8"
        for layer in ("4-bit", "8-bit"):
            assert got["zero.Init"][layer]["built"]["ds_shape"] == (16, 16)
        for name, want in reference.items():
            label = f"rank {rank}, {name}"
            case = got[name]
            # Loaded whole on every rank, as in one process: nothing has a ds_numel.
            assert {n: (d["shape"] != (0,), d["ds_numel"]) for n, d in case["loaded"].items()} == {
                n: (True, None) for n in want["loaded"]}, label
            # After deepspeed.initialize every parameter is partitioned, the quantized ones
            # too: ds_numel is the element count of the storage the rank held before.
            kind, dtype, _ = STORAGE[name]
            for n, d in case["trained"].items():
                assert d["shape"] == (0,) and d["ds_numel"] is not None, (label, n)
                base = n.replace(".base_layer", "")
                if base in want["loaded"]:
                    numel, cls = want["loaded"][base]
                    assert (d["class"], d["ds_numel"]) == (cls, numel), (label, n)
            quantized = [d for d in case["trained"].values() if d["class"] == kind]
            assert len(quantized) == 7 and {d["dtype"] for d in quantized} == {dtype}, label
            # The training is the one-process training.
            assert_matches(case["weights"], want["weights"], f"{label} adapter")
            assert_matches(case["logits"], want["logits"], f"{label} logits")
            assert case["PEFT count"] == got["4-bit NF4"]["PEFT count"], label
    # PEFT's count reads ds_numel and counts a 4-bit weight's two values per byte of storage:
    # every case counts the model's full size (the 8-bit case equals the unquantized model).
    trainable = sum(t.numel() for t in reference["8-bit"]["weights"].values())
    total = sum(numel for numel, _ in reference["8-bit"]["loaded"].values()) + trainable
    assert result.returned(0)["8-bit"]["PEFT count"] == (
        f"trainable params: {trainable:,d} || all params: {total:,d} || "
        f"trainable%: {100 * trainable / total:.4f}")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
