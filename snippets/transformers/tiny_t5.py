"""A tiny T5 built from a config, saved with save_pretrained and loaded with from_pretrained
under ZeRO-3, the way Trainer users load a model. Nothing is downloaded. The other examples on
the page import what they share from this file.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/tiny_t5.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys
import tempfile

import accelerate
import torch
import transformers
from accelerate.state import AcceleratorState
from deepspeed.accelerator import get_accelerator
from transformers import T5Config, T5ForConditionalGeneration, TrainingArguments

VOCAB, SEQ, TARGET, EXAMPLES, STEPS, SEED, LR = 32, 5, 4, 8, 3, 0, 0.1


# --8<-- [start:model]
def save_tiny_t5():
    """A T5 small enough for a test, saved where from_pretrained can load it (no download)."""
    config = T5Config(d_model=16, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                      d_kv=8, vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0)
    torch.manual_seed(SEED)
    directory = tempfile.mkdtemp(prefix="tiny-t5-")
    T5ForConditionalGeneration(config).save_pretrained(directory)
    return directory
# --8<-- [end:model]


def soft_inputs_dataset():
    """EXAMPLES soft one-hot inputs (each row sums to 1) with their target tokens."""
    generator = torch.Generator().manual_seed(SEED)
    return [{"sampled_input": torch.softmax(torch.randn(SEQ, VOCAB, generator=generator), dim=-1),
             "labels": torch.randint(0, VOCAB, (TARGET,), generator=generator)}
            for _ in range(EXAMPLES)]


# --8<-- [start:args]
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "zero_allow_untested_optimizer": True,
}


def training_arguments(world_size):
    # CPU only (how this page's examples ran here). On GPUs none of it is needed:
    # TrainingArguments(deepspeed=...) sets up DeepSpeed by itself (not run here).
    if get_accelerator().device_name() == "cpu":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        accelerate.PartialState(backend=get_accelerator().communication_backend_name())  # gloo
        cpu_only = {"accelerator_config": {"use_configured_state": True}}
    else:  # pragma: no cover - GPUs, not run here
        cpu_only = {}
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="trainer-"), deepspeed=DS_CONFIG,
        per_device_train_batch_size=EXAMPLES // world_size,  # one step sees every example
        num_train_epochs=STEPS, optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, seed=SEED, remove_unused_columns=False,
        save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
        **cpu_only,
    )
# --8<-- [end:args]


def fresh_accelerate_state():
    """One launch runs several trainings (fast tests); each starts from a new accelerate state.
    A script that trains once does not need this."""
    AcceleratorState._reset_state(reset_partial_state=True)


def main():
    directory = save_tiny_t5()
    world_size = int(os.environ["WORLD_SIZE"])
    fresh_accelerate_state()
    # --8<-- [start:load]
    args = training_arguments(world_size)  # with deepspeed=..., from_pretrained uses zero.Init
    model = T5ForConditionalGeneration.from_pretrained(directory)
    # --8<-- [end:load]
    rank = torch.distributed.get_rank()
    weight = model.shared.weight
    facts = {
        "shape": tuple(weight.shape), "ds_shape": tuple(weight.ds_shape),
        "tied": [name for name, p in model.named_parameters(remove_duplicate=False) if p is weight],
        "zero3": args.hf_deepspeed_config.is_zero3(),
    }
    if rank == 0:
        print(f"transformers {transformers.__version__}, accelerate {accelerate.__version__}")
        print(f"ZeRO-3 from TrainingArguments: {facts['zero3']}")
        print(f"shared.weight after from_pretrained: shape {facts['shape']}, ds_shape {facts['ds_shape']}")
        print(f"one Parameter, {len(facts['tied'])} names: {', '.join(facts['tied'])}")
    fresh_accelerate_state()
    return facts


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
