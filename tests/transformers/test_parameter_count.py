"""snippets/transformers/parameter_count.py: the counts of a LoRA model loaded and trained under
ZeRO-3 with Trainer. numel() is 0 for every partitioned parameter, so a count that sums numel()
is wrong (and divides by zero once every parameter is partitioned); PEFT's
print_trainable_parameters, Trainer's log line and a count that reads ds_numel give the full
count; model.num_parameters(), and the total_flos Trainer derives from it, count only what is
not partitioned. Training itself is unaffected: the trained adapter and the logits equal the same
training in one process without DeepSpeed, under both persistence thresholds."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_adapter_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/parameter_count.py"
TIMEOUT = 600  # two Trainer runs on a loaded 2-core machine
DEFAULT_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold


@pytest.fixture(scope="module")
def reference():
    """The model and LoRA adapter in one process, seeded as the example seeds them, trained with
    plain SGD on every example at once for STEPS steps (Trainer's step in the example)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET)
    model = LlamaForCausalLM.from_pretrained(ex["save_model"]())
    torch.manual_seed(ex["SEED"])
    model = get_peft_model(model, LoraConfig(**ex["LORA"]))
    shapes = {name: p.numel() for name, p in model.named_parameters()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    embeddings = {name for name in shapes if "embed_tokens" in name}
    inputs = torch.stack([row["input_ids"] for row in ex["token_dataset"]()])
    train_adapter_in_one_process(model, [inputs] * ex["STEPS"], ex["LR"])
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if name in trainable}
    return {"ex": ex, "numel": shapes, "trainable": trainable, "embeddings": embeddings,
            "tokens": inputs.numel(), "weights": weights, "logits": logits}


def peft_line(trainable, total):
    return (f"trainable params: {trainable:,d} || all params: {total:,d} || "
            f"trainable%: {100 * trainable / total:.4f}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_counts_and_training(world_size, reference, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    numel, trainable = reference["numel"], reference["trainable"]
    total, lora = sum(numel.values()), sum(numel[name] for name in trainable)
    # Under the default threshold the parameters under 100,000 values stay whole on every
    # rank after deepspeed.initialize (the adapter, the norms, the embedding and the head);
    # the projections are partitioned. With 0 every parameter is.
    whole = {name for name, n in numel.items() if n < DEFAULT_THRESHOLD}
    assert trainable < whole < set(numel)
    kept = {"threshold 0": set(), "DeepSpeed's default": whole}
    for rank in range(world_size):
        got = result.returned(rank)
        for case, result_case in got.items():
            label = f"rank {rank}, {case}"
            # Training is unaffected: the adapter and the logits equal one process's.
            assert_matches(result_case["weights"], reference["weights"], f"{label} adapter")
            assert_matches(result_case["logits"], reference["logits"], f"{label} logits")
            # from_pretrained under zero.Init partitioned every weight of the model; the
            # adapter, made afterwards by get_peft_model, is whole until Trainer starts.
            before = result_case["before"]
            assert before["parameters with numel() 0"] == len(numel) - len(trainable), label
            assert before["hand-written count"] == (
                f"trainable params: {lora} || all params: {lora} / trainable%: 100.00")
            assert before["model.num_parameters()"] == lora
            after = result_case["after"]
            whole_count = sum(numel[name] for name in kept[case])
            assert after["parameters with numel() 0"] == len(numel) - len(kept[case]), label
            assert after["model.num_parameters()"] == whole_count, label
            whole_lora = sum(numel[name] for name in kept[case] & trainable)
            line = f"trainable params: {whole_lora} || all params: {whole_count}"
            if whole_count:
                assert after["hand-written count"] == (
                    f"{line} / trainable%: {100 * whole_lora / whole_count:.2f}"), label
            else:  # the readers' "trainable params: 0", then the share divides by zero
                assert after["hand-written count"] == (
                    f"{line} / ZeroDivisionError: division by zero"), label
            # The counts that read ds_numel are the full ones, before and after.
            for counted in (before, after):
                assert counted["PEFT print_trainable_parameters"] == peft_line(lora, total)
                assert counted["parameter_count(model)"] == total
                assert counted["trainable, parameter_count"] == lora
            assert result_case["Trainer logged"] == [f"Number of trainable parameters = {lora:,}"]
            # Trainer's floating_point_ops: 6 x tokens x model.num_parameters(exclude_embeddings
            # =True), summed over the steps: only what is whole on the rank is counted.
            counted = sum(numel[name] for name in kept[case] - reference["embeddings"])
            steps = reference["ex"]["STEPS"]
            assert result_case["total_flos"] == 6 * reference["tokens"] * counted * steps, label
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
