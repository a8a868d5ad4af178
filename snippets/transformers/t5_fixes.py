"""DeepSpeed issue #1047 done right: Trainer + ZeRO-3 with the soft one-hot product inside a
wrapper module's forward, which trains like the same model in one process without DeepSpeed.
Also the product inside GatheredParameters in compute_loss: it trains here only because T5's
decoder embedding, fed token ids, holds the tied weight through backward (not a fix).

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/t5_fixes.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys
import tempfile
import traceback

import deepspeed
import torch
from deepspeed.utils import safe_get_full_grad
from torch import nn
from transformers import PrinterCallback, T5ForConditionalGeneration, Trainer, TrainerCallback

from tiny_t5 import (EXAMPLES, fresh_accelerate_state, save_tiny_t5,
                     soft_inputs_dataset, training_arguments)


# --8<-- [start:wrapper]
class SoftInputs(nn.Module):
    """Runs the soft one-hot product inside a forward, where ZeRO-3 gathers the weight."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # SoftInputs.forward reads model.shared.weight, so SoftInputs registers it.
        deepspeed.zero.register_external_parameter(self, model.shared.weight)

    def forward(self, sampled_input, labels):
        b, l, c = sampled_input.shape
        sampled_input_embed = sampled_input.view(b * l, c).mm(self.model.shared.weight)
        return self.model(inputs_embeds=sampled_input_embed.view(b, l, -1), labels=labels)
# --8<-- [end:wrapper]


# --8<-- [start:gathered]
class GatheredTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        sampled_input = inputs["sampled_input"]  # data: no gradient flows into it
        b, l, c = sampled_input.shape
        weight = model.module.shared.weight
        with deepspeed.zero.GatheredParameters(weight):  # the full weight, for reading
            sampled_input_embed = sampled_input.view(b * l, c).mm(weight)
        outputs = model(inputs_embeds=sampled_input_embed.view(b, l, -1),
                        labels=inputs["labels"])
        return outputs.loss
# --8<-- [end:gathered]


# --8<-- [start:invalid]
class DifferentiableInputsTrainer(GatheredTrainer):
    """The reader's inputs are differentiable samples: their gradient needs the weight's values
    after the with block. Against the rule."""

    samples = []  # each step's inputs and labels, to read the inputs' gradients after training
    weight_in_backward = []  # the weight's state when backward reached the product

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        sampled_input = inputs["sampled_input"].clone().requires_grad_()
        weight = model.module.shared.weight
        sampled_input.register_hook(lambda grad: self.weight_in_backward.append(
            (weight.ds_status.name, tuple(weight.shape))))
        self.samples.append((sampled_input, inputs["labels"]))
        return super().compute_loss(model, {**inputs, "sampled_input": sampled_input})
# --8<-- [end:invalid]


class Record(TrainerCallback):
    """For the comparison with plain PyTorch: each step's loss, and every parameter's full
    gradient read just before DeepSpeed's optimizer step (under DeepSpeed, Trainer runs
    backward and the step in one call)."""

    def __init__(self):
        self.losses, self.grads = [], []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        model.register_forward_hook(lambda module, inputs, outputs: self.losses.append(outputs.loss.detach()))
        zero_optimizer = optimizer.optimizer
        step = zero_optimizer.step

        def recorded_step(*step_args, **step_kwargs):
            self.grads.append({name: safe_get_full_grad(p).clone() for name, p in model.named_parameters()})
            return step(*step_args, **step_kwargs)

        zero_optimizer.step = recorded_step

    def result(self):
        losses = torch.stack(self.losses)
        torch.distributed.all_reduce(losses)  # each rank's loss is the mean over its equal share
        return {"losses": (losses / torch.distributed.get_world_size()).tolist(), "grads": self.grads}


def train(trainer_class, model, args):
    record = Record()
    trainer = trainer_class(model=model, args=args, train_dataset=soft_inputs_dataset(), callbacks=[record])
    trainer.remove_callback(PrinterCallback)  # it prints timings; the losses are printed below
    trainer.train()
    return trainer, record.result()


def error_of(call):
    """Run `call`; return its error as (type, message, the line of this file that raised).
    Printed rather than raised, so that one launch shows every case."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what the case shows
        here = [frame.line for frame in traceback.extract_tb(error.__traceback__) if frame.filename == __file__]
        return type(error).__name__, " ".join(str(error).split()), here[-1]
    return None  # save_model on the ranks that do not write files; the differentiable-inputs case


def main():
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if EXAMPLES % world_size:  # unequal shares would weigh the examples unequally
        raise ValueError(f"{EXAMPLES} examples do not split evenly over {world_size} "
                         "ranks; run on 2 or 4 ranks (the printed losses were checked "
                         "on both)")
    directory = save_tiny_t5()
    say = print if rank == 0 else (lambda *args: None)
    results = {}

    fresh_accelerate_state()
    # --8<-- [start:train_wrapper]
    args = training_arguments(world_size)  # before from_pretrained: it turns on zero.Init
    model = T5ForConditionalGeneration.from_pretrained(directory)
    trainer, results["wrapper"] = train(Trainer, SoftInputs(model), args)
    # --8<-- [end:train_wrapper]
    say("wrapper, losses by step:", " ".join(f"{loss:.6f}" for loss in results["wrapper"]["losses"]))
    # --8<-- [start:save_model]
    results["save_model"] = error_of(
        lambda: trainer.save_model(tempfile.mkdtemp(prefix="wrapper-")))
    # --8<-- [end:save_model]
    if rank == 0:  # the rank that writes the files
        kind, message, _ = results["save_model"]
        print(f"Trainer.save_model(...) with the wrapper: {kind}: {message.split(':')[0]}: ...")
    # --8<-- [start:save]
    inner = tempfile.mkdtemp(prefix="t5-")
    state_dict = trainer.accelerator.get_state_dict(trainer.deepspeed)  # every rank: it gathers
    if trainer.args.should_save:  # rank 0 holds the full weights
        state_dict = {name.removeprefix("model."): tensor for name, tensor in state_dict.items()}
        trainer.model.model.save_pretrained(inner, state_dict=state_dict)
    # --8<-- [end:save]
    results["saved"] = inner

    fresh_accelerate_state()
    args = training_arguments(world_size)
    model = T5ForConditionalGeneration.from_pretrained(directory)
    _, results["gathered"] = train(GatheredTrainer, model, args)
    say("GatheredParameters, losses by step:", " ".join(f"{loss:.6f}" for loss in results["gathered"]["losses"]))

    fresh_accelerate_state()
    args = training_arguments(world_size)
    model = T5ForConditionalGeneration.from_pretrained(directory)
    DifferentiableInputsTrainer.samples, DifferentiableInputsTrainer.weight_in_backward = [], []
    results["invalid"] = error_of(lambda: results.update(differentiable=train(DifferentiableInputsTrainer, model, args)[1]))
    say("GatheredParameters, differentiable inputs:", "raised nothing" if results["invalid"] is None
        else "{}: {}".format(*results["invalid"]))
    results["input_grads"] = [(x.detach().clone(), labels.clone(), None if x.grad is None else x.grad.clone())
                              for x, labels in DifferentiableInputsTrainer.samples]
    results["weight_in_backward"] = DifferentiableInputsTrainer.weight_in_backward
    say("  the weight when backward reached the product, by step:", DifferentiableInputsTrainer.weight_in_backward)
    fresh_accelerate_state()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
