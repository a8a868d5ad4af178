"""A plain save on rank 0 (no gather) of a model that ZeRO-3 trained with DeepSpeed's default
stage3_param_persistence_threshold (1e5 elements) instead of 0: which tensors it writes with
size 0. The tied causal LM of zero3_saves.py, with MLP matrices larger than the threshold,
and a LoRA adapter on its gate_proj, each trained with Trainer; each file is then loaded in
one process.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/zero3_saves_threshold.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys
import tempfile
import warnings

import safetensors.torch
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer

from tied_causal_lm import SEED, VOCAB, error_text, token_dataset, training_arguments
from tiny_t5 import fresh_accelerate_state
from zero3_saves import shared_folder

THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold
INTERMEDIATE = 8192  # each MLP matrix 16 x 8192 = 131072 elements: over the threshold
# --8<-- [start:lora]
LORA = {"r": 16, "lora_alpha": 32, "target_modules": ["gate_proj"]}
# gate_proj.lora_A: 16 x 16 elements; gate_proj.lora_B: 8192 x 16
# --8<-- [end:lora]


def save_wide_llama():
    """The tiny tied Llama of tied_causal_lm.py with a wide MLP, saved for from_pretrained."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=True)
    torch.manual_seed(SEED)
    directory = tempfile.mkdtemp(prefix="wide-llama-")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def train(directory, world_size, adapter):
    fresh_accelerate_state()
    # --8<-- [start:train]
    args = training_arguments(world_size, gather_on_save=True, default_threshold=True)
    model = LlamaForCausalLM.from_pretrained(directory)  # under zero.Init
    if adapter:
        torch.manual_seed(SEED)  # LoRA draws its A matrices now: the same on every rank
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT's note on tied weights
            model = get_peft_model(model, LoraConfig(**LORA))
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    # --8<-- [end:train]
    return trainer


def full_shapes(model):
    """Each parameter's full shape, under the name a save gives it (PEFT drops `.default`)."""
    return {name.replace(".default", ""): tuple(p.ds_shape)
            for name, p in model.named_parameters(remove_duplicate=False)}


def load(directory, folder, adapter):
    """The save, loaded in one process without DeepSpeed as it is meant to be loaded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's note on tied weights
        if adapter:
            return PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(directory), folder)
        return LlamaForCausalLM.from_pretrained(folder)


def main():
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    transformers.logging.set_verbosity_error()  # the load report: the error says enough
    directory = save_wide_llama()
    results = {}
    for case, adapter in (("full model", False), ("adapter", True)):
        trainer = train(directory, world_size, adapter)
        folder = shared_folder("plain-save-")
        # --8<-- [start:save]
        if rank == 0:  # a plain save on the main process: no gather
            trainer.model.save_pretrained(folder)
        # --8<-- [end:save]
        results[case] = {"folder": folder, "shapes": full_shapes(trainer.model)}
    fresh_accelerate_state()
    transformers.integrations.deepspeed.unset_hf_deepspeed_config()  # one process from here
    if rank == 0:
        for case, got in results.items():
            adapter = case == "adapter"
            name = "adapter_model.safetensors" if adapter else "model.safetensors"
            tensors = safetensors.torch.load_file(os.path.join(got["folder"], name))
            got["tensors"] = tensors
            got["load error"] = error_text(lambda: load(directory, got["folder"], adapter))
            report(case, tensors, got["shapes"], got["load error"])
    torch.distributed.barrier()
    return results


def report(case, tensors, shapes, load_error):
    print(f"{case}: save_pretrained on rank 0, without a gather, "
          f"stage3_param_persistence_threshold {THRESHOLD} (the default):")
    for empty in (True, False):
        names = [key for key, t in sorted(tensors.items()) if (t.numel() == 0) is empty]
        sizes = [f"{key} ({' x '.join(map(str, shapes[key]))})" for key in names]
        if not empty and len(names) > 4:
            largest = max(tensors[key].numel() for key in names)
            sizes = [f"{len(names)} tensors of at most {largest} elements"]
        print(f"  {'size 0' if empty else 'whole'}: {', '.join(sizes) or 'none'}")
    print(f"  loaded in one process: {load_error or 'loaded'}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
