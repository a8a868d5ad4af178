"""LoRA with modules_to_save under ZeRO-3 as readers configure it: the head alone
(modules_to_save=["lm_head"]), and the tied embedding with it. Each is trained with Trainer,
saved with save_model, and the adapter loaded in one process without DeepSpeed. The errors
readers post come from other PEFT and DeepSpeed releases; this file shows which.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/peft_modules_to_save.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys
import tempfile
import warnings

import peft
import safetensors.torch
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM, PrinterCallback, Trainer

from tied_causal_lm import SEED, error_text, save_tiny_llama, token_dataset, training_arguments
from tiny_t5 import fresh_accelerate_state

CASES = {"head": ["lm_head"], "embedding and head": ["embed_tokens", "lm_head"]}


def train_and_save(directory, world_size, modules):
    fresh_accelerate_state()
    # --8<-- [start:train]
    args = training_arguments(world_size, gather_on_save=True)
    args.set_logging(strategy="steps", steps=1)  # each loss, in state.log_history
    model = LlamaForCausalLM.from_pretrained(directory)  # under zero.Init
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        modules_to_save=modules)
    torch.manual_seed(SEED)  # LoRA draws its A matrices now: the same on every rank
    model = get_peft_model(model, config)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    adapter = tempfile.mkdtemp(prefix="lora-")
    trainer.save_model(adapter)  # every rank; rank 0 writes adapter_model.safetensors
    # --8<-- [end:train]
    engine = trainer.model_wrapped
    engine.eval()
    inputs = torch.stack([example["input_ids"] for example in token_dataset()])
    with torch.no_grad():
        logits = engine(input_ids=inputs.to(engine.device)).logits.cpu()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"adapter": adapter, "logits": logits, "inputs": inputs, "losses": losses}


def load_in_one_process(directory, adapter, inputs):
    """The adapter on the base model, in this process alone (nothing partitioned)."""
    # --8<-- [start:load]
    base = LlamaForCausalLM.from_pretrained(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on tied weights; not the point here
        model = PeftModel.from_pretrained(base, adapter)
    # --8<-- [end:load]
    with torch.no_grad():
        return model(input_ids=inputs).logits


def main():
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    directory = save_tiny_llama()
    results = {}
    for name, modules in CASES.items():
        results[name] = {"modules": modules, "error": None}
        results[name]["error"] = error_text(
            lambda: results[name].update(train_and_save(directory, world_size, modules)))
    fresh_accelerate_state()
    transformers.integrations.deepspeed.unset_hf_deepspeed_config()  # one process from here
    if rank == 0:
        print(f"peft {peft.__version__}")  # the DeepSpeed release: the page's stamp or note
        for name, got in results.items():
            print(f"modules_to_save={got['modules']}:")
            if got["error"]:  # pragma: no cover (other releases: the version matrix)
                print(f"  training raised {got['error']}")
                continue
            print("  losses:", *(f"{loss:.4f}" for loss in got["losses"]))
            saved = safetensors.torch.load_file(
                os.path.join(got["adapter"], "adapter_model.safetensors"))
            got["shapes"] = {key: tuple(value.shape) for key, value in saved.items()}
            for key, shape in sorted(got["shapes"].items()):
                if "lora" not in key:
                    print(f"  saved {key}: {shape}")
            print(f"  saved {sum('lora' in key for key in saved)} LoRA tensors, empty: "
                  f"{sorted(key for key, value in saved.items() if 'lora' in key and not value.numel())}")
            got["load error"] = error_text(lambda: got.update(loaded=load_in_one_process(
                directory, got["adapter"], got["inputs"])))
            if got["load error"]:  # pragma: no cover (other releases: the version matrix)
                print(f"  loading raised {got['load error']}")
                continue
            limit = 64 * torch.finfo(torch.float32).eps * got["logits"].abs().max()
            close = bool((got["loaded"] - got["logits"]).abs().max() <= limit)
            print(f"  loaded in one process: logits equal the trained model's: {close}")
    torch.distributed.barrier()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
