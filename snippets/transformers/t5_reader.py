"""DeepSpeed issue #1047 as its reader ran it: Trainer + ZeRO-3, a compute_loss that multiplies
soft one-hot inputs with model.module.shared.weight, and registration tried in a subclass.
Every attempt fails; one launch runs them all and prints each error.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/t5_reader.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys
import traceback

import deepspeed
import torch
import torch.nn.functional as F
from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration, Trainer

from tiny_t5 import fresh_accelerate_state, save_tiny_t5, soft_inputs_dataset, training_arguments


# --8<-- [start:auto]
class Model(AutoModelForSeq2SeqLM):  # the reader's class
    def __init__(self, *args):
        print("Model.__init__ runs")
        super().__init__(self, *args)
        deepspeed.zero.register_external_parameter(self, self.shared.weight)  # never reached
# --8<-- [end:auto]


# --8<-- [start:concrete]
# The concrete class: from_pretrained runs this __init__.
class RegisteredT5(T5ForConditionalGeneration):
    def __init__(self, config):
        super().__init__(config)
        deepspeed.zero.register_external_parameter(self, self.shared.weight)
        self.registered = True
# --8<-- [end:concrete]


# --8<-- [start:loss]
class ReaderTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        sampled_input = inputs["sampled_input"]
        b, l, c = sampled_input.shape
        sampled_input_embed = sampled_input.view(b * l, c).mm(model.module.shared.weight)
        outputs = model(inputs_embeds=sampled_input_embed.view(b, l, -1),  # never reached
                        labels=inputs["labels"])
        return outputs.loss  # never reached: the product above raises
# --8<-- [end:loss]


# --8<-- [start:transpose]
class TransposeTrainer(Trainer):  # the same product, written as F.linear(x, W^T)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        sampled_input_embed = F.linear(inputs["sampled_input"],
                                       model.module.shared.weight.transpose(0, 1))
        outputs = model(inputs_embeds=sampled_input_embed,  # never reached
                        labels=inputs["labels"])
        return outputs.loss  # never reached: the product above raises
# --8<-- [end:transpose]


def error_of(call):
    """Run `call`; return its error as (type, message, the line of this file that raised).
    Printed rather than raised, so that one launch shows every case."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what the case shows
        here = [frame.line for frame in traceback.extract_tb(error.__traceback__) if frame.filename == __file__]
        return type(error).__name__, str(error), here[-1]
    return None  # never reached: every case here fails


def main():
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    directory = save_tiny_t5()
    say = print if rank == 0 else (lambda *args: None)
    results = {}

    fresh_accelerate_state()
    args = training_arguments(world_size)
    # --8<-- [start:auto_run]
    model = Model.from_pretrained(directory)
    say(f"Model.from_pretrained returned {type(model).__name__}")
    model = Model.from_config(T5Config.from_pretrained(directory))
    say(f"Model.from_config returned {type(model).__name__}")
    results["constructor"] = error_of(lambda: Model(T5Config.from_pretrained(directory)))
    # --8<-- [end:auto_run]
    results["auto"] = [type(Model.from_pretrained(directory)).__name__, type(model).__name__]
    say("Model(config): {}: {}".format(*results["constructor"]))

    for name, trainer_class, model_class in [
        ("mm", ReaderTrainer, Model),  # Model.from_pretrained: the reader's run
        ("transpose", TransposeTrainer, Model),
        ("registered", ReaderTrainer, RegisteredT5),  # as if the reader's __init__ had run
    ]:
        fresh_accelerate_state()
        args = training_arguments(world_size)
        model = model_class.from_pretrained(directory)
        registered = [p is model.shared.weight for p in getattr(model, "_external_params", {}).values()]
        results[f"{name} registered"] = registered
        trainer = trainer_class(model=model, args=args, train_dataset=soft_inputs_dataset())
        results[name] = error_of(trainer.train)
        say(f"{trainer_class.__name__}, {type(model).__name__} (shared.weight registered: {registered == [True]}): "
            f"{results[name][0]}: {results[name][1]}")
    fresh_accelerate_state()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
