"""snippets/transformers/zero3_saves.py: every save of a tied causal LM and of its LoRA adapter
trained with Trainer under ZeRO-3, and the load of each file in one process. The saves that
write tensors of size 0 write exactly the model's (or the adapter's) tensors that way, and
their load raises the exact message built here from the model's shapes; every other file
loads to the logits of the same training done in one process without DeepSpeed, and so do
the fixes and the recoveries from the DeepSpeed checkpoints."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_adapter_in_one_process
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/zero3_saves.py"
TIMEOUT = 900  # four Trainer runs, their saves and the loads, on a loaded 2-core machine
EMPTY_FULL = [("full", "state_dict"), ("full", "save_pretrained"),
              ("full", "save_pretrained .bin")]
EMPTY_ADAPTER = [("adapter", "save_pretrained"), ("adapter", "get_peft_model_state_dict")]
FULL_WHOLE = [("full", name) for name in ("after an evaluation", "get_state_dict", "gathered",
                                          "save_model")] + [("full, gather off", "recovered")]
ADAPTER_WHOLE = [("adapter", name) for name in ("get_state_dict", "gathered", "save_model",
                                                "recovered")] + [("adapter, gather off",
                                                                  "save_model")]
IGNORED = ("RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error. "
           "For details look at the above report!")


def size_mismatch(owner, shapes):
    """The message load_state_dict raises for these {name: full shape}, in this order."""
    return (f"RuntimeError: Error(s) in loading state_dict for {owner}: " + ". ".join(
        f"size mismatch for {name}: copying a param with shape torch.Size([0]) from checkpoint, "
        f"the shape in current model is torch.Size({list(shape)})" for name, shape in shapes.items())
        + ".")


@pytest.fixture(scope="module")
def reference():
    """The same trainings in one process without DeepSpeed: the tied LM with SGD over every
    example at once for STEPS steps (tests/transformers/test_tied_causal_lm.py's reference),
    and the adapter, seeded as the example seeds it before get_peft_model."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    ex = example_namespace(SNIPPET, with_siblings=["tied_causal_lm"])
    directory = ex["save_tiny_llama"]()
    inputs = torch.stack([row["input_ids"] for row in ex["token_dataset"]()])
    full = LlamaForCausalLM.from_pretrained(directory)
    optimizer = torch.optim.SGD(full.parameters(), lr=ex["LR"])
    for _ in range(ex["STEPS"]):
        full(input_ids=inputs, labels=inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model = LlamaForCausalLM.from_pretrained(directory)
    torch.manual_seed(ex["SEED"])
    adapter = get_peft_model(model, LoraConfig(**ex["LORA"]))
    train_adapter_in_one_process(adapter, [inputs] * ex["STEPS"], ex["LR"])
    with torch.no_grad():
        want = {"full": full(input_ids=inputs).logits, "adapter": adapter(input_ids=inputs).logits}
    trained = {name for name, p in adapter.named_parameters() if p.requires_grad}
    # The adapter's tensors in the model, in load order, and their names in the adapter file.
    in_model = {name: tuple(t.shape) for name, t in adapter.state_dict().items() if name in trained}
    in_file = sorted(get_peft_model_state_dict(adapter))
    return {"inputs": inputs, "logits": want, "full shapes": {
        name: tuple(t.shape) for name, t in full.state_dict().items()},
        "adapter shapes": in_model, "adapter keys": in_file, "trained": sorted(trained)}


def empty_keys(row):
    return sorted(key for tensors in row["tensors"].values()
                  for key, shape in tensors.items() if shape == (0,))


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_save_and_its_load(world_size, reference, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    for rank in range(world_size):
        want = result.returned(rank)["want"]
        # The trained models equal the one-process trainings on every rank.
        for case, logits in want.items():
            kind = "adapter" if case.startswith("adapter") else "full"
            assert_matches(logits["logits"], reference["logits"][kind], f"rank {rank} {case}")
    got = result.returned(0)["results"]
    full_shapes = reference["full shapes"]
    # Saved from the partitioned model: every tensor has size 0, both names of the tie too.
    for case, name in EMPTY_FULL:
        row = got[case][name]
        assert empty_keys(row) == sorted(full_shapes), (case, name)
    assert got["full"]["state_dict"]["load error"] == size_mismatch("LlamaForCausalLM", full_shapes)
    for name in ("save_pretrained", "save_pretrained .bin"):
        row = got["full"][name]
        assert row["files"] == ["config.json", "generation_config.json", "model.safetensors"]
        assert row["load error"] == IGNORED
        assert row["report"] == {
            key: f"MISMATCH | Reinit due to size mismatch - ckpt: torch.Size([0]) vs "
                 f"model:torch.Size({list(shape)})" for key, shape in full_shapes.items()}
    for case, name in EMPTY_ADAPTER:
        row = got[case][name]
        assert empty_keys(row) == reference["adapter keys"], (case, name)
        assert row["load error"] == size_mismatch("PeftModel", reference["adapter shapes"])
    # Every other save holds the whole tensors, and loads to the one-process training.
    for case, name in FULL_WHOLE + ADAPTER_WHOLE:
        row = got[case][name]
        kind = "adapter" if case.startswith("adapter") else "full"
        assert row["load error"] is None and empty_keys(row) == [], (case, name)
        assert_matches(row["logits"], reference["logits"][kind], f"{case}, {name}")
        assert row["tied"] is (kind == "full"), (case, name)
        if kind == "adapter":
            assert sorted(next(iter(row["tensors"].values()))) == reference["adapter keys"]
    # The setting off: Trainer writes a DeepSpeed checkpoint, no weights; accelerate refuses.
    off = got["full, gather off"]
    assert {"global_step3", "zero_to_fp32.py"} <= set(off["save_model"]["files"])
    assert off["save_model"]["tensors"] == {}
    assert off["save_model"]["load error"] == (
        "OSError: Error no file named model.safetensors, or pytorch_model.bin, found in "
        "directory <folder>.")
    assert off["get_state_dict"]["raised"].startswith(
        "ValueError: Cannot get 16bit model weights because "
        "`stage3_gather_16bit_weights_on_model_save` in DeepSpeed config is False.")
    # The checkpoint at the last step holds exactly the adapter's trained tensors.
    assert got["adapter"]["recovered"]["checkpoint keys"] == reference["trained"]
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))
