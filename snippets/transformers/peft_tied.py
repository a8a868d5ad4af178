"""LoRA with modules_to_save on the tied embedding and head of tied_causal_lm.py's tiny Llama,
trained with Trainer under ZeRO-3: are the two trainable copies kept equal, what does saving
write, and does the merged model equal the trained one? PEFT's default and
ensure_weight_tying=True.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/peft_tied.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys
import tempfile
import warnings

import deepspeed
import peft
import safetensors.torch
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM, PrinterCallback, Trainer

from tied_causal_lm import SEED, error_text, save_tiny_llama, token_dataset, training_arguments
from tiny_t5 import fresh_accelerate_state


def lora_config(ensure_weight_tying):
    # --8<-- [start:config]
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["embed_tokens", "lm_head"],
                      ensure_weight_tying=ensure_weight_tying)
    # --8<-- [end:config]


def messages(warned):
    return [" ".join(str(w.message).split()) for w in warned if w.category is UserWarning]


def trained_copies(model):
    """The full weights of the trainable copies of the embedding and the head (a collective)."""
    embed = model.get_input_embeddings().modules_to_save["default"].weight
    head = model.get_output_embeddings().modules_to_save["default"].weight
    with deepspeed.zero.GatheredParameters([embed, head]):
        return embed is head, embed.detach().clone(), head.detach().clone()


def train_lora(directory, world_size, ensure_weight_tying):
    fresh_accelerate_state()
    # --8<-- [start:train]
    args = training_arguments(world_size, gather_on_save=True)
    args.set_logging(strategy="steps", steps=1)  # each loss, in state.log_history
    model = LlamaForCausalLM.from_pretrained(directory)
    torch.manual_seed(SEED)  # LoRA draws its A matrices now: the same on every rank
    with warnings.catch_warnings(record=True) as warned:  # shown in the output
        warnings.simplefilter("always")
        model = get_peft_model(model, lora_config(ensure_weight_tying))
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    adapter = tempfile.mkdtemp(prefix="lora-")
    trainer.save_model(adapter)  # every rank: it gathers; rank 0 writes the adapter
    # --8<-- [end:train]
    same, embed, head = trained_copies(model)
    engine = trainer.model_wrapped
    engine.eval()
    with torch.no_grad():
        inputs = torch.stack([example["input_ids"] for example in token_dataset()])
        logits = engine(input_ids=inputs.to(engine.device)).logits.cpu()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"adapter": adapter, "one parameter": same, "warned": messages(warned),
            "copies equal": torch.equal(embed, head), "logits": logits,
            "inputs": inputs, "losses": losses}


def merged_logits(directory, adapter, inputs):
    """In one process without DeepSpeed: the base model, the adapter, merged."""
    # --8<-- [start:merge]
    base = LlamaForCausalLM.from_pretrained(directory)
    with warnings.catch_warnings(record=True) as warned:  # shown in the output
        warnings.simplefilter("always")
        merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    # --8<-- [end:merge]
    with torch.no_grad():
        logits = merged(input_ids=inputs).logits
    tied = merged.lm_head.weight is merged.get_input_embeddings().weight
    return logits, tied, messages(warned)


def main():
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    directory = save_tiny_llama()
    results = {}
    for ensure in (False, True):
        results[ensure] = {"error": None}
        results[ensure]["error"] = error_text(
            lambda: results[ensure].update(train_lora(directory, world_size, ensure)))
    fresh_accelerate_state()
    transformers.integrations.deepspeed.unset_hf_deepspeed_config()  # one process from here
    if rank == 0:
        print(f"peft {peft.__version__}")
        for ensure, got in results.items():
            print(f"ensure_weight_tying={ensure}:")
            if got["error"]:  # pragma: no cover (both cases train on these versions)
                print(f"  {got['error']}")
                continue
            for message in got["warned"]:
                print(f"  get_peft_model warned: {message}")
            keys = sorted(safetensors.torch.load_file(
                os.path.join(got["adapter"], "adapter_model.safetensors")))
            got["keys"] = keys
            print(f"  after training: one Parameter {got['one parameter']}, "
                  f"copies equal {got['copies equal']}")
            print(f"  adapter keys: {[key for key in keys if 'lora' not in key]} "
                  f"and {sum('lora' in key for key in keys)} LoRA tensors")
            got["merged logits"], got["merged tied"], got["merge warned"] = merged_logits(
                directory, got["adapter"], got["inputs"])
            for message in got["merge warned"]:
                print(f"  merge_and_unload warned: {message}")
            # Equal up to float32 rounding: 64 epsilons of the largest logit.
            limit = 64 * torch.finfo(torch.float32).eps * got["logits"].abs().max()
            close = bool((got["merged logits"] - got["logits"]).abs().max() <= limit)
            print(f"  merged in one process: head is embedding {got['merged tied']}, "
                  f"logits close to the trained model's: {close}")
    torch.distributed.barrier()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
