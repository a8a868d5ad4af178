"""What a Trainer script builds under ZeRO-3: TrainingArguments(deepspeed=...) first (it
configures ZeRO-3), then from_pretrained or from_config, which build the model inside
deepspeed.zero.Init. Gemma 3 (text only, and with a SigLIP vision tower), BERT and Llama, each
with a padding token; every weight a load gives compared with the same load in one process.
Then the order that keeps Transformers' initialization away from partitioned weights: build
the model first, then TrainingArguments and Trainer, trained like one process.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/load_under_zero3.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here). Nothing is downloaded.
"""
import os
import sys
import tempfile
import traceback
from pathlib import Path

import accelerate
import deepspeed
import torch
import transformers
from accelerate.state import AcceleratorState
from deepspeed.accelerator import get_accelerator
from transformers import PrinterCallback, Trainer, TrainingArguments

VOCAB, WIDE_VOCAB, DIM, SEQ, EXAMPLES, STEPS, SEED, LR = 64, 8192, 16, 6, 8, 3, 0, 0.1
TOLERANCE = 64 * torch.finfo(torch.float32).eps  # of the largest value compared


def gemma3_text(vocab=VOCAB):
    return transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=DIM, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=32, sliding_window=8, pad_token_id=0)


def gemma3_vision_language():
    vision = transformers.SiglipVisionConfig(
        hidden_size=DIM, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, image_size=16, patch_size=8)
    return transformers.Gemma3Config(
        text_config=gemma3_text(), vision_config=vision, mm_tokens_per_image=4,
        image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)


def bert():
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, pad_token_id=0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def llama():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        pad_token_id=0)


# Each model class with a tiny config whose embedding has a padding row (pad_token_id=0),
# and the Auto class whose from_config builds it.
MODELS = {
    "Gemma3ForCausalLM": (gemma3_text, "AutoModelForCausalLM"),
    "Gemma3ForConditionalGeneration": (gemma3_vision_language, "AutoModelForImageTextToText"),
    "BertForMaskedLM": (bert, "AutoModelForMaskedLM"),
    "LlamaForCausalLM": (llama, "AutoModelForCausalLM"),
}


def ds_config(default_threshold=False):
    zero3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if default_threshold:  # DeepSpeed's own 1e5 elements: smaller weights stay whole
        del zero3["stage3_param_persistence_threshold"]
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_optimization": zero3, "zero_allow_untested_optimizer": True}


def fresh_accelerate_state():
    """One launch makes several TrainingArguments; each starts from a new accelerate state.
    A script that makes one does not need this."""
    AcceleratorState._reset_state(reset_partial_state=True)


def training_arguments(default_threshold=False):
    """TrainingArguments(deepspeed=...), as a Trainer script makes them (with the two
    settings that ZeRO-3 under Trainer needs on CPU; not needed on GPUs)."""
    fresh_accelerate_state()
    if get_accelerator().device_name() == "cpu":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        accelerate.PartialState(backend=get_accelerator().communication_backend_name())
        cpu_only = {"accelerator_config": {"use_configured_state": True}}
    else:  # pragma: no cover - GPUs, not run here
        cpu_only = {}
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="trainer-"),
        deepspeed=ds_config(default_threshold),
        per_device_train_batch_size=EXAMPLES // int(os.environ["WORLD_SIZE"]),
        num_train_epochs=STEPS, optim="sgd", learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, seed=SEED,
        save_strategy="no", logging_strategy="no", report_to="none",
        disable_tqdm=True, **cpu_only)


def saved(name, config):
    """A checkpoint of the model, saved in one process for from_pretrained (no download)."""
    torch.manual_seed(SEED)
    directory = tempfile.mkdtemp(prefix=f"{name}-")
    getattr(transformers, name)(config).save_pretrained(directory)
    return directory


def full_weights(model):
    """name -> the full tensor (gathered where ZeRO-3 partitioned it)."""
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):  # nothing to do if not partitioned
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def matches(got, want):
    """Within the project's tolerance: 64 float32 epsilons of the largest value compared."""
    return all(
        (got[name] - want[name]).abs().max() <= TOLERANCE * want[name].abs().max()
        for name in want)


def raised(call):
    """The error `call` raises and the function it came from, or what it returned."""
    try:
        return {"returned": call()}
    except Exception as error:  # noqa: BLE001  # pragma: no cover - older releases
        where = traceback.extract_tb(error.__traceback__)[-1]
        return {"raised": f"{type(error).__name__}: {error}",
                "in": f"{where.name} ({Path(where.filename).name})"}


def token_dataset():
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(1, VOCAB, (EXAMPLES, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def trained_in_one_process(model):
    """The same SGD steps in one process: each step sees every example."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tokens = torch.stack([example["input_ids"] for example in token_dataset()])
    for _ in range(STEPS):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_weights(model)


def trained_by_trainer(build, reference, built_first=True):
    """Trainer's training of the model `build` gives, built before TrainingArguments exist
    (or after, the usual order), against the same SGD steps in one process."""
    torch.manual_seed(SEED)
    if built_first:
        # --8<-- [start:built_first]
        model = build()  # no ZeRO-3 configured yet: plain PyTorch, no zero.Init
        args = training_arguments()  # then ZeRO-3
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
        trainer.remove_callback(PrinterCallback)
        trainer.train()  # deepspeed.initialize partitions the built model
        # --8<-- [end:built_first]
    else:
        args = training_arguments()
        model = build()  # inside zero.Init
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    weights = full_weights(trainer.model)
    return {"trained like one process": matches(weights, reference), "weights": weights}


def loaded(name, directory, reference):
    """from_pretrained with ZeRO-3 configured; its weights against the one-process load."""
    # --8<-- [start:from_pretrained]
    model = getattr(transformers, name).from_pretrained(directory)  # inside zero.Init
    # --8<-- [end:from_pretrained]
    weights = full_weights(model)
    return {"embedding shape": tuple(model.get_input_embeddings().weight.shape),
            "weights equal one process's": matches(weights, reference), "weights": weights}


def from_config(auto_class, config):
    # --8<-- [start:from_config]
    model = getattr(transformers, auto_class).from_config(config)  # inside zero.Init
    # --8<-- [end:from_config]
    return {"embedding shape": tuple(model.get_input_embeddings().weight.shape)}


def say(label, row):
    if "raised" in row:  # older releases: the version matrix
        print(f"{label}: raised {row['raised']}, in {row['in']}")  # pragma: no cover
    else:
        print(f"{label}:", ", ".join(f"{k} {v}" for k, v in row["returned"].items()
                                     if k != "weights"))


def main():
    transformers.logging.set_verbosity_error()
    # Saved and loaded in one process, before the process group exists.
    directories = {name: saved(name, config()) for name, (config, _) in MODELS.items()}
    wide = saved("Gemma3ForCausalLM", gemma3_text(WIDE_VOCAB))
    references = {name: full_weights(getattr(transformers, name).from_pretrained(directory))
                  for name, directory in directories.items()}
    wide_reference = full_weights(transformers.Gemma3ForCausalLM.from_pretrained(wide))
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())

    # Built before TrainingArguments: loaded with from_pretrained, and built from a config;
    # and, to compare, a model that loads on every release run, in the usual order.
    builds = {
        "Gemma3ForCausalLM.from_pretrained": lambda: transformers.Gemma3ForCausalLM
        .from_pretrained(directories["Gemma3ForCausalLM"]),
        "LlamaForCausalLM(config)": lambda: transformers.LlamaForCausalLM(llama()),
        "LlamaForCausalLM.from_pretrained": lambda: transformers.LlamaForCausalLM
        .from_pretrained(directories["LlamaForCausalLM"]),
    }
    trained_references = {}
    for name, build in builds.items():  # in one process, before ZeRO-3 is configured
        torch.manual_seed(SEED)
        trained_references[name] = trained_in_one_process(build())
    trained = {}
    for name, order in (("Gemma3ForCausalLM.from_pretrained", "before"),
                        ("LlamaForCausalLM(config)", "before"),
                        ("LlamaForCausalLM.from_pretrained", "after")):
        trained[f"{name} {order} TrainingArguments, then Trainer"] = raised(
            lambda: trained_by_trainer(builds[name], trained_references[name],
                                       order == "before"))

    rows = {}
    # --8<-- [start:reader]
    args = training_arguments()  # deepspeed=...: ZeRO-3 configured from here on
    # --8<-- [end:reader]
    for name, directory in directories.items():
        rows[f"{name}.from_pretrained"] = raised(
            lambda: loaded(name, directory, references[name]))
    for name, (config, auto_class) in MODELS.items():
        rows[f"{name}, {auto_class}.from_config"] = raised(
            lambda: from_config(auto_class, config()))

    # DeepSpeed's default stage3_param_persistence_threshold (1e5 elements): after
    # deepspeed.initialize it keeps smaller weights whole (64 x 16), not larger (8192 x 16).
    del args
    args = training_arguments(default_threshold=True)  # noqa: F841 (alive while loading)
    for label, directory, reference in (
            ("64 x 16", directories["Gemma3ForCausalLM"], references["Gemma3ForCausalLM"]),
            ("8192 x 16", wide, wide_reference)):
        rows[f"default threshold, {label} embedding, Gemma3ForCausalLM.from_pretrained"] = \
            raised(lambda: loaded("Gemma3ForCausalLM", directory, reference))
    rows.update(trained)

    if torch.distributed.get_rank() == 0:
        for label, row in rows.items():
            say(label, row)
    return rows


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
