"""TRL's unwrap_model_for_generation around a weight transfer under ZeRO-3, the way GRPOTrainer
hands the trained weights to vLLM (read the gathered state dict, no forward in the block),
with gradient accumulation: 2 micro-steps per optimizer step, a transfer before each
micro-step, so one in two comes after a micro-step that took no optimizer step.
The helper is given the model inside the engine (GRPOTrainer before TRL 0.16.0), the engine
(since), or the model inside after emptying ds_active_sub_modules by hand (TRL issue #2840);
and, given the model inside: with generate() in the block too, and without accumulation but
with a checkpoint save and an evaluation forward after every step.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/trl_weight_transfer.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import shutil
import sys
import tempfile

import accelerate
import deepspeed
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig, LlamaForCausalLM
from trl.models.utils import unwrap_model_for_generation

VOCAB, LENGTH, BATCH, ACCUMULATION, MICRO_STEPS, LR, SEED = 32, 6, 2, 2, 6, 0.5, 0


def tiny_llama():
    """A tied Llama small enough for a test, built from its config (no download)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16, tie_word_embeddings=True)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def batch(micro_step, rank):
    generator = torch.Generator().manual_seed(1000 * micro_step + rank)
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)


def cpu_accelerator(config):
    """An Accelerator with DeepSpeed on this CPU run (over gloo), as TRL's trainers hold one.
    On GPUs, `accelerate launch` sets this up (not run here)."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerate.PartialState(backend=get_accelerator().communication_backend_name())
    return accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))


def held(model):
    """The weights that a module still holds (a non-empty ds_active_sub_modules)."""
    return sorted(name for name, p in model.named_parameters() if p.ds_active_sub_modules)


def shared_directory():
    """A temporary directory made on rank 0, its path given to every rank."""
    path = [tempfile.mkdtemp(prefix="checkpoints-") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(path)
    return path[0]


def save_and_evaluate(engine, accelerator, tokens, directory):
    """What Trainer does between steps: save a checkpoint (the engine's, and the 16-bit
    weights that save_model gathers) and run an evaluation forward."""
    engine.save_checkpoint(directory)
    accelerator.get_state_dict(engine)
    engine.eval()
    with torch.no_grad():
        engine(tokens)
    engine.train()


def train(give_engine=False, empty_first=False, generate_in_block=False,
          accumulation=ACCUMULATION, between_steps=False):
    rank = torch.distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": BATCH,
              "gradient_accumulation_steps": accumulation,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    accelerator = cpu_accelerator(config)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, optimizer = accelerator.prepare(model, optimizer)  # a DeepSpeedEngine, partitioned
    record = {"transferred": [], "held_after_backward": [], "held_after_step": [],
              "error": None}
    directory = shared_directory() if between_steps else None
    try:
        for micro_step in range(MICRO_STEPS):
            # --8<-- [start:step]
            if empty_first:  # TRL issue #2840's workaround
                for param in engine.module.parameters():
                    param.ds_active_sub_modules.clear()
            tokens = batch(micro_step, rank).to(engine.device)
            helper_gets = engine if give_engine else engine.module
            with unwrap_model_for_generation(helper_gets, accelerator) as unwrapped:
                # what GRPOTrainer hands to vLLM: every weight whole
                weights = {name: w.clone() for name, w in unwrapped.state_dict().items()}
                if generate_in_block:  # the helper's other use: sampling from the model
                    unwrapped.generate(tokens[:, :2], max_new_tokens=2, pad_token_id=0)
            loss = engine(tokens, labels=tokens).loss
            engine.backward(loss)
            record["held_after_backward"].append(held(engine.module))  # printed below
            engine.step()  # an optimizer step every ACCUMULATION micro-steps
            # --8<-- [end:step]
            if between_steps:
                save_and_evaluate(engine, accelerator, tokens, directory)
            record["held_after_step"].append(held(engine.module))
            record["transferred"].append(weights)
    except (AssertionError, RuntimeError) as error:  # pragma: no cover (other releases)
        record["error"] = f"{type(error).__name__}: {error}"
    del accelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    if directory and rank == 0:
        shutil.rmtree(directory)
    return record


CASES = {"engine.module": {}, "engine": {"give_engine": True},
         "engine.module, emptied first": {"empty_first": True},
         "engine.module, generate() in the block": {"generate_in_block": True},
         "engine.module, no accumulation, save and evaluation between steps":
             {"accumulation": 1, "between_steps": True}}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    results = {}
    for case, options in CASES.items():
        results[case] = record = train(**options)
        say(f"unwrap_model_for_generation({case}): "
            f"{len(record['transferred'])} of {MICRO_STEPS} weight transfers"
            + (f", then {record['error']}" if record["error"] else ""))
        for micro_step in range(2 if case == "engine" else 0):  # the two micro-steps of a step
            say(f"  still held after micro-step {micro_step}'s backward: "
                f"{record['held_after_backward'][micro_step]}, "
                f"after its step: {record['held_after_step'][micro_step]}")
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
