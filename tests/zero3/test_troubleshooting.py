"""Every message on the troubleshooting page was printed by a real run: it is in the output file
of the example the page names (those files are compared with fresh runs by the snippet tests)."""

import re

import pytest

from rankrun import marks
from rankrun.runner import ROOT

pytestmark = marks.files

PAGE = ROOT / "docs/zero3/troubleshooting.md"
# message heading on the page -> the output file that shows it
SOURCES = {
    "RuntimeError: size mismatch, got input (10), mat (10x8), vec (0)": ["automatic_detection.out"],
    "RuntimeError: 'weight' must be 2-D": ["automatic_detection.out", "../transformers/reference_model.out",
                                           "../pipeline/fsdp1_shared_units.out",
                                           "used_before_initialize.out",
                                           "../pipeline/fsdp_outside_forward.out"],
    "RuntimeError: mat2 must be a matrix": ["soft_inputs_outside.out", "gathered_in_loss.out"],
    "RuntimeError: The size of tensor a (0) must match the size of tensor b (8) at non-singleton dimension 1": [
        "gathered_in_loss.out"],
    "RuntimeError: Function SumBackward1 returned an invalid gradient at index 0 - got [0] but expected shape "
    "compatible with [6, 6]": ["generated_models.out"],
    "IndexError: Dimension out of range (expected to be in range of [-1, 0], but got 1)": [
        "automatic_detection.out", "constructor_shape.out"],
    "IndexError: index 0 is out of bounds for dimension 0 with size 0": [
        "automatic_detection.out", "../versions/load_under_zero3.md"],
    "RuntimeError: Detected in-place modification of ZeRO-3 parameters inside GatheredParameters "
    "with modifier_rank=None. Use modifier_rank=<rank> to broadcast updates across ranks.": ["gathered_parameters.out"],
    "AttributeError: 'Parameter' object has no attribute 'ds_status'": ["../transformers/resize_embeddings.out"],
    "ValueError: not enough values to unpack (expected 2, got 1)": ["../transformers/resize_embeddings.out"],
    "RuntimeError: Cannot free a ZeRO-3 parameter while it is still active in submodules": ["free_active_param.out"],
    "RuntimeError: Error(s) in loading state_dict for Linear: size mismatch for weight: copying a param with "
    "shape torch.Size([6, 6]) from checkpoint, the shape in current model is torch.Size([0]).": [
        "generated_copies.out"],
    "TypeError: Signature mismatch between <function get_new_tensor_fn_for_dtype.<locals>.new_tensor at 0x…> and "
    "<function tensor_pynew at 0x…>: (cls, *args, **kwargs) -> torch.Tensor != (cls: type[typing.Any], "
    "data: torch.Tensor, requires_grad: bool = False, **kwargs: Any) -> Any": ["../transformers/import_inside_zero_init.out"],
    # Saving and loading shared weights (docs/zero3/saving-shared-weights.md)
    "RuntimeError: Some tensors share memory, this will lead to duplicate memory on disk and potential "
    "differences when loading them again": ["zero3_checkpoint.out", "../transformers/tied_causal_lm.out"],
    "ZeRORuntimeException: The checkpoint being loaded used a DP world size of 2 but the current world size "
    "is 4. Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not "
    "currently supported.": ["zero3_checkpoint_resume.out"],
    "KeyError: 0": ["zero3_checkpoint_resume.out"],
    "FileNotFoundError: can't find *_optim_states.pt files in directory '<folder>'": [
        "../pipeline/pipeline_to_plain.out"],
    "stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead, use "
    "zero_to_fp32.py to recover weights": ["../transformers/tied_causal_lm.out"],
    # What each save writes from a partitioned model, and PEFT on other releases
    # (snippets/transformers/zero3_saves.py; the version matrix's note of peft_modules_to_save.py)
    "RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM: size mismatch for "
    "model.embed_tokens.weight: copying a param with shape torch.Size([0]) from checkpoint, the shape "
    "in current model is torch.Size([32, 16])": ["../transformers/zero3_saves.out"],
    "RuntimeError: Error(s) in loading state_dict for PeftModel: size mismatch for "
    "base_model.model.model.embed_tokens.modules_to_save.default.weight: copying a param with shape "
    "torch.Size([0]) from checkpoint, the shape in current model is torch.Size([32, 16])": [
        "../transformers/zero3_saves.out", "../versions/peft_modules_to_save.md"],
    "RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error. For details "
    "look at the above report!": ["../transformers/zero3_saves.out"],
    "OSError: Error no file named model.safetensors, or pytorch_model.bin, found in directory "
    "<folder>.": ["../transformers/zero3_saves.out"],
    "ValueError: Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` "
    "in DeepSpeed config is False.": ["../transformers/zero3_saves.out"],
    "AssertionError: {'id': 16, 'status': 'NOT_AVAILABLE', 'numel': 0, 'ds_numel': 0, 'shape': (0,), "
    "'ds_shape': (0,), 'requires_grad': True, 'grad_shape': None, 'persist': True, "
    "'active_sub_modules': {42}, 'ds_tensor.shape': torch.Size([0])}": ["../versions/peft_modules_to_save.md"],
    "AttributeError: 'Linear' object has no attribute 'ds_grads_remaining'": [
        "../versions/peft_modules_to_save.md"],
    "RuntimeError: shape '[-1, 0]' is invalid for input of size 720": ["../versions/resize_embeddings.md"],
    # Transformers 4.43.0 to 4.43.2 (the version matrix's note of resize_embeddings.py)
    "IndexError: index out of range in self": ["../versions/resize_embeddings.md"],
    # Converting a tied checkpoint, saves that write a tied weight twice
    # (docs/zero3/converting-tied-checkpoints.md); the KeyError also heads an entry under FSDP2 below
    "KeyError: 'lm_head.weight'": ["../transformers/convert_tied_megatron.out",
                                   "../pipeline/accelerate_fsdp2_releases.txt",
                                   "../pipeline/hf_pipeline_loader.out"],
    'Unexpected key(s) in state_dict: "output_layer.weight".': [
        "../transformers/convert_tied_megatron.out", "../transformers/fsdp_save_both_names.out"],
    "RuntimeError: Error(s) in loading state_dict for ValueHead: size mismatch for summary.weight: "
    "copying a param with shape torch.Size([1, 16]) from checkpoint, the shape in current model is "
    "torch.Size([0])": ["../transformers/value_head_load.out"],
    # Tied embeddings with FSDP2 and pipelines, initialization under zero.Init
    "ValueError: Parameter 'model.embed_tokens.weight' is shared with a parameter already managed by "
    "another FSDP group. For shared/tied parameters, use fully_shard([module_a, module_b]) to place "
    "them in the same FSDP group.": ["../pipeline/accelerate_fsdp2_releases.txt"],
    "ValueError: FSDP2 mapping failed (missing: ['lm_head.weight']). This is likely due to tied "
    "embeddings (config has tie_word_embeddings=True but checkpoint has separate weights).": [
        "../pipeline/accelerate_fsdp2_tied.out", "../pipeline/accelerate_fsdp2_releases.txt"],
    "TypeError: The only supported seed types are: None,": [
        "../pipeline/deepspeed_tied_embed_stage_seeded.txt"],
    "ValueError: Fan in and fan out can not be computed for tensor with fewer than 2 dimensions": [
        "../transformers/init_under_zero_init.out", "../versions/load_under_zero3.md"],
    # Tied weights with FSDP: meta-device init and FSDP1 units (pipeline/fsdp-tied-init-checkpoints.md)
    'Missing key(s) in state_dict: "lm_head.weight".': ["../pipeline/fsdp_meta_init_llama.out"],
    "RuntimeError: size mismatch, got input (24), mat (24x8), vec (64)": ["../pipeline/fsdp1_shared_units.out"],
    # DeepSpeed pipelines with ZeRO, Megatron Core beyond two stages (pipeline/tied-layers*.md)
    "AssertionError: ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism": [
        "../pipeline/zero3_pipeline.out", "../pipeline/zero1_pipeline_offload.out"],
    "ZeRORuntimeException: You are using ZeRO-Offload with a client provided optimizer": [
        "../pipeline/zero1_pipeline_offload.out"],
    "AssertionError: embedding group is not initialized": ["../pipeline/megatron_four_stages.out"],
    # Quantized models and counting parameters (quantized_zero3.py, parameter_count.py,
    # versions/trainer_param_count.py)
    "ValueError: DeepSpeed Zero-3 is not compatible with passing a `device_map`.": [
        "../transformers/quantized_zero3.out"],
    "ValueError: matmul_4bit: quant_state.shape must be 2D [N, K]": ["../transformers/quantized_zero3.out"],
    "ZeroDivisionError: integer division or modulo by zero": ["../transformers/quantized_zero3.out"],
    "AttributeError: 'Parameter' object has no attribute 'ds_numel'": [
        "../transformers/trainer_param_count.txt"],
    "ZeroDivisionError: division by zero": ["../transformers/parameter_count.out"],
    # FSDP: a weight read or changed outside the wrapped forward (pipeline/fsdp-outside-forward.md)
    "RuntimeError: Output 0 of View is a view and its base or another view of its base has been "
    "modified inplace.": ["../pipeline/fsdp_outside_forward.out"],
    "AssertionError: Non-root FSDP instance's `_is_root` should not have been set yet or should "
    "have been set to `False`": ["../pipeline/fsdp_outside_forward.out"],
    "RuntimeError: FSDP state has already been lazily initialized for": [
        "../pipeline/fsdp_outside_forward.out"],
    "got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before calling "
    "distributed operators!": ["../pipeline/fsdp_outside_forward.out",
                               "../pipeline/fsdp_weight_in_loss.out"],
    "NotImplementedError: writeback=True and rank0_only=True is not supported yet": [
        "../pipeline/fsdp_weight_writes.out"],
    "RuntimeError: setStorage:": ["../pipeline/fsdp_weight_writes.out"],
    # Fused losses, TRL's generation helper and copied models
    "RuntimeError: size mismatch, got input (4), mat (4x16), vec (0)": ["../transformers/fused_loss.out"],
    "RuntimeError: The size of tensor a (0) must match the size of tensor b (16) at non-singleton "
    "dimension 1": ["../transformers/fused_loss.out"],
    "RuntimeError: 0 active drivers ([]). There should only be one.": ["liger_on_cpu.txt"],
    "ValueError: DeepSpeed ZeRO-3 is enabled and is not compatible with": ["../transformers/copied_reference.out"],
    "AttributeError: 'Parameter' object has no attribute 'ds_id'": ["../transformers/copied_reference.out"],
    "AssertionError: {'id': 0, 'status': 'AVAILABLE', 'numel': 512, 'ds_numel': 512, 'shape': (32, 16), "
    "'ds_shape': (32, 16), 'requires_grad': True, 'grad_shape': None, 'persist': False, "
    "'active_sub_modules': {2}, 'ds_tensor.shape': torch.Size([256])}": ["../versions/trl_weight_transfer.md"],
    # Generation between training steps: the prefetch trace and the hybrid engine
    "RuntimeError: tracing error at step 3:": ["prefetch_trace.out"],
    "RuntimeError: still have inflight params": ["../versions/prefetch_inflight.md"],
    "ValueError: This op had not been implemented on CPU backend.": ["../transformers/hybrid_engine.out"],
    "RuntimeError: Transformers version 5.24.0 exceeds version 4.43.4! After transformers version 4.43.4, "
    "BLOOM inference with DeepSpeed is no longer supported.": ["../transformers/hybrid_engine.out"],
    # Before deepspeed.initialize: launchers and frozen models (zero3/around-initialize.md)
    "ValueError: max() arg is an empty sequence": ["frozen_model_engine.out"],
    "assert len(set(t.dtype for t in tensors)) == 1": ["frozen_model_engine.out"],
    "ModuleNotFoundError: No module named 'mpi4py'": ["../transformers/trainer_launch_python.txt"],
}


# Messages with an entry in two groups of the page, one per cause (SOURCES lists each once, where
# it first occurs, with the output files of both). The later entry's group existed first: the
# new heading carries an id of its own ({#...}), so that the older one keeps its anchor.
REPEATED = {"KeyError: 'lm_head.weight'"}


def headings():
    # A message with backticks is fenced with two: ### `` a `b` c ``; an explicit id may follow.
    return [m[1] for m in re.findall(r"^### (`+) ?(.+?) ?\1(?: \{#[\w-]+\})?$", PAGE.read_text(), flags=re.M)]


def test_page_lists_exactly_these_messages():
    found = headings()
    assert list(dict.fromkeys(found)) == list(SOURCES)
    assert {message for message in found if found.count(message) > 1} == REPEATED


@pytest.mark.parametrize("message", list(SOURCES))
def test_message_was_printed_by_a_run(message):
    for name in SOURCES[message]:
        assert message in (ROOT / "snippets/zero3" / name).read_text(), (message, name)


def test_silent_cases_are_shown():
    page = PAGE.read_text()
    gathered = (ROOT / "snippets/zero3/gathered_parameters.out").read_text()
    # the line that shows the change vanishing after the block
    assert "zeroed with modifier_rank=None: sum 0.0000 inside, 3.3562 after" in gathered
    assert "gathered_parameters.out" in page
    assert "changed in a constructor" in page
    # a change made with GatheredParameters(modifier_rank=0) after initialize, undone by the step
    changed = (ROOT / "snippets/zero3/change_after_initialize.out").read_text()
    for name in ("SGD", "Adam"):
        line = (f"{name}: GatheredParameters(modifier_rank=0) to 1.0 after initialize: [1.0] after the block, "
                f"step loss 12.2887, [0.5] after engine.step()")
        assert line in changed, line
    assert "change_after_initialize.out" in page
    # the table has one row per case, and the sentence above it counts them
    # a forward's write to its gathered weight (lost_writes.py): the rows keep their norm
    lost = (ROOT / "snippets/zero3/lost_writes.out").read_text()
    assert "as written: losses 2.8354 2.7863 2.7879, largest norm of a used row 4.7108" in lost
    assert "lost_writes.out" in (ROOT / "docs/zero3/lost-writes.md").read_text()
    # a constructor's assignment, load or MultiheadAttention under zero.Init (generated copies)
    copies = (ROOT / "snippets/zero3/check_shared_reads_generated_copies.txt").read_text()
    for construct in ("weight.data = a tensor", "load_state_dict from a partitioned layer",
                      "nn.MultiheadAttention"):
        assert re.search(rf"^  {re.escape(construct)}: \d+ x silently wrong$", copies, re.M), construct
    rows = re.findall(r"^\|.*\|$", page.split("## Silently wrong")[1], flags=re.M)
    assert len(rows) == 2 + 5  # header, separator, one row per case
    assert "found five cases" in page


def note_lines(note, release):
    """The lines of a version note about the runs with Transformers `release`."""
    text = (ROOT / "snippets/versions" / note).read_text()
    return [line for line in text.splitlines() if f"transformers {release}," in line]


@pytest.mark.parametrize(("release", "raises"), [
    ("4.33.2", "RuntimeError: shape '[-1, 0]' is invalid for input of size 720"),
    ("4.42.4", None),
    ("4.43.0", "IndexError: index out of range in self"),
    ("4.43.1", "IndexError: index out of range in self"),
    ("4.43.2", "IndexError: index out of range in self"),
])
def test_resize_entries_name_the_releases_that_printed_them(release, raises):
    """The resizing entries' release lists are what the version matrix printed, release by release."""
    [line] = note_lines("resize_embeddings.md", release)
    if raises is None:
        assert "raises" not in line and "stops before" not in line, line
    else:
        assert f"`{raises}`" in line, line
