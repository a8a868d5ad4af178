"""A quantized (bitsandbytes) model under ZeRO-3: Transformers' refusal of a device_map,
bitsandbytes layers built inside zero.Init, and the path that trains: the ZeRO-3 config alive
(TrainingArguments first), from_pretrained with the quantization config and no device_map,
a LoRA adapter (QLoRA), Trainer. 4-bit NF4 with the default uint8 storage, 4-bit with float32
storage, and 8-bit, each trained three steps; what ZeRO-3 partitioned, parameter by parameter.
Nothing is downloaded; bitsandbytes runs its CPU kernels here.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/quantized_zero3.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import contextlib
import io
import os
import sys
import warnings

import bitsandbytes as bnb
import deepspeed
import peft
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from peft import LoraConfig, get_peft_model
from transformers import BitsAndBytesConfig, LlamaForCausalLM, PrinterCallback, Trainer

from tied_causal_lm import SEED, error_text, save_tiny_llama, token_dataset
from tied_causal_lm import training_arguments
from tiny_t5 import fresh_accelerate_state

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
# --8<-- [start:quantizations]
QUANTIZATIONS = {  # compute in float32: the CPU here, and the one-process reference
    "4-bit NF4": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32),
    "4-bit NF4, float32 storage": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32),
    "8-bit": BitsAndBytesConfig(load_in_8bit=True),
}
# --8<-- [end:quantizations]
ZERO3 = {"train_micro_batch_size_per_gpu": 1,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def device_map_refused(directory, world_size):
    fresh_accelerate_state()
    # --8<-- [start:device_map]
    args = training_arguments(world_size, gather_on_save=True)  # ZeRO-3 configured
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = LlamaForCausalLM.from_pretrained(
        directory, quantization_config=quantization, device_map="auto")
    # --8<-- [end:device_map]
    return args, model  # never reached: from_pretrained raises


def describe(param):
    return {"class": type(param).__name__, "dtype": str(param.dtype).replace("torch.", ""),
            "shape": tuple(param.shape), "ds_shape": tuple(getattr(param, "ds_shape", ())),
            "ds_numel": getattr(param, "ds_numel", None)}


def four_bit_in_zero_init(seen):
    """A 4-bit layer built inside zero.Init, then moved to the device (which quantizes)."""
    # --8<-- [start:zero_init]
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        layer = bnb.nn.Linear4bit(16, 16, bias=False, compute_dtype=torch.float32)
    seen["built"] = describe(layer.weight)
    layer = layer.to(get_accelerator().current_device_name())  # quantizes its weight
    seen["moved"] = describe(layer.weight)
    layer(torch.randn(2, 16))
    # --8<-- [end:zero_init]


def eight_bit_in_zero_init(seen):
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        layer = bnb.nn.Linear8bitLt(16, 16, bias=False, has_fp16_weights=False)
    seen["built"] = describe(layer.weight)
    layer.to(get_accelerator().current_device_name())  # quantizes its weight


def in_zero_init():
    results = {}
    for name, build in (("4-bit", four_bit_in_zero_init), ("8-bit", eight_bit_in_zero_init)):
        seen = {}
        results[name] = {"error": error_text(lambda: build(seen)), **seen}
    return results


def train(directory, world_size, quantization):
    fresh_accelerate_state()
    # --8<-- [start:supported]
    args = training_arguments(world_size, gather_on_save=True)  # first: ZeRO-3 configured
    model = LlamaForCausalLM.from_pretrained(  # no device_map
        directory, quantization_config=quantization, dtype=torch.float32)
    loaded = {name: describe(p) for name, p in model.named_parameters()}
    torch.manual_seed(SEED)  # LoRA draws its A matrices now: the same on every rank
    model = get_peft_model(model, LoraConfig(**LORA))
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.remove_callback(PrinterCallback)
    trainer.train()  # deepspeed.initialize partitions every parameter, then 3 steps
    # --8<-- [end:supported]
    trained = {name.replace("base_model.model.", ""): describe(p)
               for name, p in model.named_parameters()}
    return trainer, loaded, trained


def results_of(trainer):
    """The trained adapter in full, the logits on every example, PEFT's count (every rank).
    The model stays in training mode: bitsandbytes' CPU inference kernel (eval mode, no
    gradient) needs widths that are multiples of 32."""
    model = trainer.model
    lora = {name: p for name, p in model.named_parameters() if p.requires_grad}
    with deepspeed.zero.GatheredParameters(list(lora.values())):
        weights = {name: p.detach().clone() for name, p in lora.items()}
    inputs = torch.stack([example["input_ids"] for example in token_dataset()])
    engine = trainer.model_wrapped
    with torch.no_grad():
        logits = engine(input_ids=inputs.to(engine.device)).logits.cpu()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model.print_trainable_parameters()
    return {"weights": weights, "logits": logits, "PEFT count": out.getvalue().strip()}


def main():
    world_size = int(os.environ["WORLD_SIZE"])
    directory = save_tiny_llama()
    results = {"device_map": error_text(lambda: device_map_refused(directory, world_size))}
    results["zero.Init"] = in_zero_init()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' notes on the CPU kernels it uses
        for name, quantization in QUANTIZATIONS.items():
            trainer, loaded, trained = train(directory, world_size, quantization)
            results[name] = {"loaded": loaded, "trained": trained, **results_of(trainer)}
    if torch.distributed.get_rank() == 0:
        print_report(results)
    torch.distributed.barrier()
    return results


def print_report(results):
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, "
          f"bitsandbytes {bnb.__version__}")
    print(f"from_pretrained(..., device_map='auto'): {results['device_map']}")
    for name, seen in results["zero.Init"].items():
        print(f"{name} layer built in zero.Init:")
        for when, label in (("built", "built"), ("moved", "moved to the device")):
            if when in seen:
                weight = seen[when]
                print(f"  {label}: {weight['class']} {weight['dtype']}, shape "
                      f"{weight['shape']}, ds_shape {weight['ds_shape']}")
        print(f"  raised: {seen['error']}")
    print()
    case = results["4-bit NF4"]
    partitioned = sum(p["ds_numel"] is not None for p in case["loaded"].values())
    print(f"4-bit NF4: parameters with a ds_numel after from_pretrained: {partitioned} "
          f"of {len(case['loaded'])}")
    print("4-bit NF4 + LoRA after training with Trainer under ZeRO-3 (threshold 0),")
    print("every shape (0,); name: class, as loaded -> ds_shape, ds_numel:")
    for name, after in case["trained"].items():
        before = case["loaded"].get(name.replace(".base_layer", ""))
        loaded = f"{before['dtype']} {before['shape']}" if before else "LoRA"
        short = name.replace("model.layers.0.", "").replace("self_attn.", "")
        print(f"  {short.replace('mlp.', '')}: {after['class']}, {loaded} -> "
              f"{after['ds_shape']}, {after['ds_numel']}")
    print()
    print("q_proj's quantized weight in each case (after training):")
    for name in QUANTIZATIONS:
        weight = results[name]["trained"]["model.layers.0.self_attn.q_proj.base_layer.weight"]
        print(f"  {name}: {weight['class']} {weight['dtype']}, shape {weight['shape']}, "
              f"ds_shape {weight['ds_shape']}, ds_numel {weight['ds_numel']}")
    print()
    for name in QUANTIZATIONS:
        print(f"{name}: PEFT's count after training: {results[name]['PEFT count']}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
