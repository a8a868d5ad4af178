"""A tiny Llama-style causal LM with tie_word_embeddings=True, trained with Trainer under
ZeRO-3 and saved with save_model (safetensors), then two ways a reader's own code breaks the
tie when saving, and their fixes. Nothing is downloaded.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/tied_causal_lm.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here). The saved folders stay in the temporary
directory; load them in one process with LlamaForCausalLM.from_pretrained(folder).
"""
import logging
import os
import re
import sys
import tempfile

import accelerate
import safetensors.torch
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments

from tiny_t5 import fresh_accelerate_state

VOCAB, SEQ, EXAMPLES, STEPS, SEED, LR = 32, 6, 8, 3, 0, 0.1


# --8<-- [start:model]
def save_tiny_llama():
    """A causal LM whose lm_head is its input embedding, saved for from_pretrained."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=True)
    torch.manual_seed(SEED)
    directory = tempfile.mkdtemp(prefix="tiny-llama-")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory
# --8<-- [end:model]


def token_dataset():
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def training_arguments(world_size, gather_on_save, default_threshold=False):
    """The Transformers page's recipe (tiny_t5.py), with the gather setting as a choice, and
    DeepSpeed's own stage3_param_persistence_threshold (1e5 elements) if asked."""
    # --8<-- [start:gather]
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": gather_on_save,
        },
        "zero_allow_untested_optimizer": True,
    }
    # --8<-- [end:gather]
    if default_threshold:  # left out: small parameters stay whole
        del ds_config["zero_optimization"]["stage3_param_persistence_threshold"]
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


class Warnings(logging.Handler):
    """Collects what Trainer logs as warnings (shown below, not hidden in stderr)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(" ".join(record.getMessage().split()))


def train_and_save(directory, world_size, gather_on_save):
    fresh_accelerate_state()
    # --8<-- [start:train]
    args = training_arguments(world_size, gather_on_save)  # before from_pretrained
    model = LlamaForCausalLM.from_pretrained(directory)  # under zero.Init: partitioned
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    saved = tempfile.mkdtemp(prefix="trained-llama-")
    trainer.save_model(saved)  # every rank: it gathers the weights; rank 0 writes
    # --8<-- [end:train]
    return trainer, saved


def weight_files(folder):
    return sorted(name for name in os.listdir(folder) if not name.endswith(".json"))


def error_text(call):
    """The error `call` raised. safetensors names the tensors in a Python set, whose order
    changes from run to run: printed sorted."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what the case shows
        text = f"{type(error).__name__}: {' '.join(str(error).split())}"
        return re.sub(r"\{('[^{}]*')\}", lambda m: "{" + ", ".join(sorted(m[1].split(", "))) + "}", text)
    return None


def broken_ties(saved, warnings):
    """Two ways a reader's code breaks the tie when saving, in one process (no DeepSpeed)."""
    results = {}
    # --8<-- [start:save_file]
    model = LlamaForCausalLM.from_pretrained(saved)
    path = os.path.join(tempfile.mkdtemp(prefix="state-dict-"), "model.safetensors")
    # state_dict() holds the tied weight under both names, one storage:
    results["save_file"] = error_text(
        lambda: safetensors.torch.save_file(model.state_dict(), path))
    safetensors.torch.save_model(model, path)  # the fix: one copy, one name kept
    fresh = LlamaForCausalLM(model.config)  # other weights, tied by its config
    safetensors.torch.load_model(fresh, path)  # fills both names from the one kept
    # --8<-- [end:save_file]
    results["save_model_keys"] = sorted(safetensors.torch.load_file(path))
    results["load_model"] = {
        "tied": fresh.lm_head.weight is fresh.get_input_embeddings().weight,
        "weights equal the saved model's": all(
            torch.equal(fresh.state_dict()[name], tensor)
            for name, tensor in model.state_dict().items())}
    # --8<-- [start:untie]
    model = LlamaForCausalLM.from_pretrained(saved)
    # The reader gives the head its own copy to train it apart from the embedding...
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone() * 2)
    untied = tempfile.mkdtemp(prefix="untied-")
    model.save_pretrained(untied)  # ...the config still says tie_word_embeddings=True
    warnings.messages.clear()
    reloaded = LlamaForCausalLM.from_pretrained(untied)
    # --8<-- [end:untie]
    results["untied_warnings"] = list(warnings.messages)
    results["untied_keys"] = sorted(safetensors.torch.load_file(
        os.path.join(untied, "model.safetensors")))
    results["untied_reloaded"] = {
        "tied": reloaded.lm_head.weight is reloaded.get_input_embeddings().weight,
        "head equals the saved head": torch.equal(reloaded.lm_head.weight, model.lm_head.weight)}
    # --8<-- [start:untie_fix]
    model.config.tie_word_embeddings = False  # say what the model is, then save
    fixed = tempfile.mkdtemp(prefix="untied-fixed-")
    model.save_pretrained(fixed)
    warnings.messages.clear()
    reloaded = LlamaForCausalLM.from_pretrained(fixed)
    # --8<-- [end:untie_fix]
    results["fixed_warnings"] = list(warnings.messages)
    results["fixed_keys"] = sorted(safetensors.torch.load_file(
        os.path.join(fixed, "model.safetensors")))
    results["fixed_reloaded"] = {
        "tied": reloaded.lm_head.weight is reloaded.get_input_embeddings().weight,
        "head equals the saved head": torch.equal(reloaded.lm_head.weight, model.lm_head.weight)}
    return results


def main():
    world_size = int(os.environ["WORLD_SIZE"])
    if EXAMPLES % world_size:  # uneven shares: other steps, another checkpoint
        raise ValueError(f"{EXAMPLES} examples do not split evenly over {world_size} "
                         "ranks; run on 2 or 4 ranks (the saved model was checked on "
                         "both)")
    directory = save_tiny_llama()
    warnings = Warnings()
    transformers.logging.get_logger("transformers").addHandler(warnings)
    trainer, saved = train_and_save(directory, world_size, gather_on_save=True)
    rank = torch.distributed.get_rank()
    say = print if rank == 0 else (lambda *args: None)
    trained_logits = None
    engine = trainer.model_wrapped
    engine.eval()
    with torch.no_grad():  # every rank: ZeRO-3 gathers the weights for the forward
        inputs = torch.stack([example["input_ids"] for example in token_dataset()])
        trained_logits = engine(input_ids=inputs.to(engine.device)).logits.cpu()
    results = {"saved": saved, "logits": trained_logits, "files": weight_files(saved)}
    say(f"transformers {transformers.__version__}: save_model wrote {results['files']}")
    if rank == 0:
        keys = sorted(safetensors.torch.load_file(os.path.join(saved, "model.safetensors")))
        results["keys"] = keys
        say(f"  its keys: {keys}")
    warnings.messages.clear()
    _, saved_off = train_and_save(directory, world_size, gather_on_save=False)
    results["gather_off"] = {"files": weight_files(saved_off), "warnings": list(warnings.messages)}
    say(f"gather off: save_model wrote {results['gather_off']['files']}")
    for message in warnings.messages:
        say(f"  warning: {message}")
    fresh_accelerate_state()
    transformers.integrations.deepspeed.unset_hf_deepspeed_config()  # one process from here
    if rank == 0:
        results["broken"] = broken_ties(saved, warnings)
        for key, value in results["broken"].items():
            print(f"{key}: {value}")
    torch.distributed.barrier()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
