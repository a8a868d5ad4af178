"""Counting the parameters of a model that ZeRO-3 partitions: a Llama-style model loaded with
from_pretrained under ZeRO-3, a LoRA adapter, trained three steps with Trainer. The count a
training script writes itself (numel), PEFT's print_trainable_parameters, Trainer's log line,
model.num_parameters() and the count from ds_numel, before and after training; under
stage3_param_persistence_threshold 0 and under DeepSpeed's default. Nothing is downloaded.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/parameter_count.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import contextlib
import io
import logging
import os
import sys
import tempfile

import accelerate
import deepspeed
import peft
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer
from transformers import TrainingArguments

from tied_causal_lm import Warnings, error_text
from tiny_t5 import fresh_accelerate_state

VOCAB, SEQ, EXAMPLES, STEPS, SEED, LR, HIDDEN = 32, 6, 8, 3, 0, 0.1, 384
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def save_model():
    """Wide enough that each projection (384 x 384 = 147,456 values) is above DeepSpeed's
    default persistence threshold (100,000), as every projection of a real model is."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(SEED)
    directory = tempfile.mkdtemp(prefix="llama-")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def token_dataset():
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def training_arguments(world_size, threshold):
    """The Transformers page's recipe; threshold None leaves DeepSpeed's default."""
    zero = {"stage": 3}
    if threshold is not None:
        zero["stage3_param_persistence_threshold"] = threshold
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                 "zero_optimization": zero, "zero_allow_untested_optimizer": True}
    if get_accelerator().device_name() == "cpu":  # CPU only, as on the Transformers page
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        accelerate.PartialState(backend=get_accelerator().communication_backend_name())
        cpu_only = {"accelerator_config": {"use_configured_state": True}}
    else:  # pragma: no cover - GPUs, not run here
        cpu_only = {}
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="trainer-"), deepspeed=ds_config,
        per_device_train_batch_size=EXAMPLES // world_size,  # one step sees every example
        num_train_epochs=STEPS, optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, seed=SEED, save_strategy="no",
        logging_strategy="no", report_to="none", disable_tqdm=True, **cpu_only,
    )


# --8<-- [start:hand]
def print_trainable_parameters(model):
    """The count many training scripts carry: numel() of each parameter."""
    trainable, total = 0, 0
    for _, param in model.named_parameters():
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    print(f"trainable params: {trainable} || all params: {total}")
    print(f"trainable%: {100 * trainable / total:.2f}")
# --8<-- [end:hand]


# --8<-- [start:fix]
def parameter_count(model, trainable_only=False):
    """The full count on every rank, with or without ZeRO-3."""
    return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
               for p in model.parameters() if p.requires_grad or not trainable_only)
# --8<-- [end:fix]


def printed(call):
    """What `call` printed, then the error it raised, if any: one line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        error = error_text(call)
    return " / ".join(out.getvalue().strip().splitlines() + ([error] if error else []))


def counts(model):
    return {
        "hand-written count": printed(lambda: print_trainable_parameters(model)),
        "PEFT print_trainable_parameters": printed(model.print_trainable_parameters),
        "model.num_parameters()": model.num_parameters(),
        "parameter_count(model)": parameter_count(model),
        "trainable, parameter_count": parameter_count(model, trainable_only=True),
        "parameters with numel() 0": sum(p.numel() == 0 for p in model.parameters()),
        "parameters": len(list(model.parameters())),
    }


def train(directory, world_size, threshold):
    fresh_accelerate_state()
    # --8<-- [start:train]
    args = training_arguments(world_size, threshold)  # before from_pretrained
    model = LlamaForCausalLM.from_pretrained(directory)  # under zero.Init: partitioned
    torch.manual_seed(SEED)  # LoRA draws its A matrices now: the same on every rank
    model = get_peft_model(model, LoraConfig(**LORA))
    before = counts(model)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.remove_callback(PrinterCallback)
    result = trainer.train()  # deepspeed.initialize, then three steps
    after = counts(model)
    # --8<-- [end:train]
    return trainer, before, after, result.metrics["total_flos"]


def trained(trainer):
    """The trained adapter's tensors in full, and the logits on every example (every rank)."""
    model = trainer.model
    lora = {name: p for name, p in model.named_parameters() if p.requires_grad}
    with deepspeed.zero.GatheredParameters(list(lora.values())):
        weights = {name: p.detach().clone() for name, p in lora.items()}
    inputs = torch.stack([example["input_ids"] for example in token_dataset()])
    engine = trainer.model_wrapped
    with torch.no_grad():
        logits = engine(input_ids=inputs.to(engine.device)).logits.cpu()
    return weights, logits


def main():
    world_size = int(os.environ["WORLD_SIZE"])
    directory = save_model()
    logged = Warnings()  # collects what Trainer logs
    logged.setLevel(logging.INFO)
    trainer_logger = transformers.logging.get_logger("transformers.trainer")
    trainer_logger.addHandler(logged)
    trainer_logger.setLevel(logging.INFO)
    results = {}
    for name, threshold in (("threshold 0", 0), ("DeepSpeed's default", None)):
        logged.messages.clear()
        trainer, before, after, flos = train(directory, world_size, threshold)
        weights, logits = trained(trainer)
        logged_count = [m for m in logged.messages if "trainable parameters" in m]
        results[name] = {"before": before, "after": after, "total_flos": flos,
                         "Trainer logged": logged_count, "weights": weights,
                         "logits": logits}
    if torch.distributed.get_rank() == 0:
        print_report(results)
    torch.distributed.barrier()
    return results


def print_report(results):
    default = DeepSpeedZeroConfig().param_persistence_threshold
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, "
          f"deepspeed {deepspeed.__version__}")
    print(f"DeepSpeed's default stage3_param_persistence_threshold: {default:,}")
    print(f"values in each projection (q_proj.weight): {HIDDEN * HIDDEN:,}")
    for name, result in results.items():
        print(f"stage3_param_persistence_threshold: {name}")
        for when in ("before", "after"):
            label = {"before": "after get_peft_model, before Trainer.train()",
                     "after": "after Trainer.train()"}[when]
            print(f"  {label}:")
            for what, value in result[when].items():
                print(f"    {what}: {value}")
        print(f"  Trainer logged: {' '.join(result['Trainer logged'])}")
        print(f"  total_flos: {result['total_flos']}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
