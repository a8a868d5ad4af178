"""A Trainer script with a ZeRO-3 config, as readers start it: with torchrun (one process or
several), or with plain `python`. Under torchrun, from_pretrained partitions the model, Trainer
trains it inside a DeepSpeed engine, and the trained model's logits equal the same training in
one process. Under plain python (no launcher) on the pinned releases it stops in from_pretrained,
where zero.Init looks for the processes a launcher would have described.

Run on CPU:
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/trainer_launch.py
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 snippets/transformers/trainer_launch.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here). Nothing is downloaded.
"""
import os
import sys
import tempfile

import accelerate
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments

VOCAB, SEQ, EXAMPLES, STEPS, SEED, LR = 32, 6, 8, 3, 0, 0.1


def save_tiny_llama():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16, tie_word_embeddings=True)
    torch.manual_seed(SEED)
    directory = tempfile.mkdtemp(prefix="tiny-llama-")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def token_dataset():
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def cpu_only_settings():
    """The Transformers page's CPU recipe, for several processes over gloo. Applied only under
    a launcher: a launcher's variables are what it reads (not run on GPUs)."""
    if get_accelerator().device_name() != "cpu" or "LOCAL_RANK" not in os.environ:
        return {}  # pragma: no cover - plain python (a fresh process) or GPUs
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerate.PartialState(backend=get_accelerator().communication_backend_name())
    return {"accelerator_config": {"use_configured_state": True}}


def main():
    directory = save_tiny_llama()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if EXAMPLES % world_size:  # pragma: no cover - uneven shares (3 ranks: not run)
        raise ValueError(f"{EXAMPLES} examples do not split evenly over {world_size} "
                         "ranks; run on 1, 2 or 4 ranks (the trained model was checked on "
                         "1 and 2)")
    # --8<-- [start:script]
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="trainer-"), deepspeed=ds_config,
        per_device_train_batch_size=EXAMPLES // world_size,  # a step sees every example
        num_train_epochs=STEPS, optim="sgd", learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, seed=SEED,
        save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
        **cpu_only_settings())
    model = LlamaForCausalLM.from_pretrained(directory)  # inside zero.Init: partitioned
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    # --8<-- [end:script]
    rank = torch.distributed.get_rank()
    say = print if rank == 0 else (lambda *args: None)
    engine = trainer.model_wrapped
    say(f"transformers {transformers.__version__}, {world_size} process(es): "
        f"embedding shape {tuple(model.model.embed_tokens.weight.shape)}, "
        f"trained inside {type(engine).__name__}")
    engine.eval()
    with torch.no_grad():  # every rank: the engine gathers the weights for the forward
        inputs = torch.stack([example["input_ids"] for example in token_dataset()])
        logits = engine(input_ids=inputs.to(engine.device)).logits.cpu()
    say(f"trained model's logits: sum {logits.sum().item():.4f}")
    return {"logits": logits, "engine": type(engine).__name__}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
