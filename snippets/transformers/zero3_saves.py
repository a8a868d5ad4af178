"""What each way of saving writes from a model that ZeRO-3 partitions, and whether the file
loads: a tiny tied causal LM, and a LoRA adapter with modules_to_save on its tied embedding
and head, each trained with Trainer, then saved every way Transformers, PEFT, accelerate and
DeepSpeed offer, each to its own folder. Then every file is loaded in one process without
DeepSpeed. The table it prints is the one on the page.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/zero3_saves.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import contextlib
import io
import os
import re
import sys
import tempfile
import warnings

import deepspeed
import safetensors.torch
import torch
import transformers
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from peft import LoraConfig, PeftModel, get_peft_model
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from transformers import LlamaForCausalLM, PrinterCallback, Trainer

from tied_causal_lm import STEPS, SEED, Warnings, error_text, save_tiny_llama
from tied_causal_lm import token_dataset, training_arguments
from tiny_t5 import fresh_accelerate_state

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": ["embed_tokens", "lm_head"]}


def rank():
    return torch.distributed.get_rank()


def shared_folder(prefix):
    """One folder for every rank (rank 0's): a DeepSpeed checkpoint has a file per rank."""
    folder = [tempfile.mkdtemp(prefix=prefix) if rank() == 0 else None]
    torch.distributed.broadcast_object_list(folder, src=0)
    return folder[0]


def train(directory, world_size, gather_on_save, adapter):
    """Trainer under ZeRO-3, three steps; with a LoRA adapter, a checkpoint at the last step
    (checkpoint-3 holds a DeepSpeed checkpoint: global_step3)."""
    fresh_accelerate_state()
    args = training_arguments(world_size, gather_on_save)
    args.output_dir = shared_folder("trainer-")
    if adapter:
        args.set_save(strategy="steps", steps=STEPS)
    model = LlamaForCausalLM.from_pretrained(directory)  # under zero.Init: partitioned
    if adapter:
        torch.manual_seed(SEED)  # LoRA draws its A matrices now: the same on every rank
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT's note on tied weights: see peft_tied.py
            model = get_peft_model(model, LoraConfig(**LORA))
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer


def trained_logits(trainer):
    """The trained model's logits (every rank: ZeRO-3 gathers the weights for the forward).
    Called after the saves: on the pinned stack the weights were still gathered after this
    forward, and a plain save then wrote them whole (the row "after an evaluation")."""
    engine = trainer.model_wrapped
    engine.eval()
    inputs = torch.stack([example["input_ids"] for example in token_dataset()])
    with torch.no_grad():
        return engine(input_ids=inputs.to(engine.device)).logits.cpu()


def full_model_saves(trainer):
    """Every way to save the full model, each into its own folder."""
    model, engine, accelerator = trainer.model, trainer.model_wrapped, trainer.accelerator
    names = ["state_dict", "save_pretrained", "save_pretrained .bin", "get_state_dict",
             "gathered", "save_model"]
    folders = {name: shared_folder("save-") for name in names}
    # --8<-- [start:full_saves]
    if rank() == 0:  # what a reader writes on the main process
        torch.save(model.state_dict(), os.path.join(folders["state_dict"], "model.pt"))
        model.save_pretrained(folders["save_pretrained"])
        model.save_pretrained(folders["save_pretrained .bin"], safe_serialization=False)
    # --8<-- [end:full_saves]
    # --8<-- [start:full_gathered]
    state_dict = accelerator.get_state_dict(engine)  # every rank: a collective
    if rank() == 0:
        model.save_pretrained(folders["get_state_dict"], state_dict=state_dict)
    # --8<-- [end:full_gathered]
    # --8<-- [start:full_fix]
    weights = list(model.parameters())
    with deepspeed.zero.GatheredParameters(weights):  # every rank
        if rank() == 0:
            torch.save(model.state_dict(), os.path.join(folders["gathered"], "model.pt"))
    # --8<-- [end:full_fix]
    # --8<-- [start:save_model]
    trainer.save_model(folders["save_model"])  # every rank
    # --8<-- [end:save_model]
    return {name: {"folder": path} for name, path in folders.items()}


def gather_off_saves(trainer):
    """With stage3_gather_16bit_weights_on_model_save false."""
    results = {"save_model": {"folder": shared_folder("save-")}}
    trainer.save_model(results["save_model"]["folder"])
    results["get_state_dict"] = {"raised": error_text(
        lambda: trainer.accelerator.get_state_dict(trainer.model_wrapped))}
    return results


def adapter_saves(trainer):
    """Every way to save the adapter, each into its own folder."""
    model, engine, accelerator = trainer.model, trainer.model_wrapped, trainer.accelerator
    names = ["save_pretrained", "get_peft_model_state_dict", "get_state_dict", "gathered",
             "save_model"]
    folders = {name: shared_folder("adapter-") for name in names}
    # --8<-- [start:adapter_saves]
    if rank() == 0:
        model.save_pretrained(folders["save_pretrained"])
        path = os.path.join(folders["get_peft_model_state_dict"], "adapter.safetensors")
        safetensors.torch.save_file(get_peft_model_state_dict(model), path)
    # --8<-- [end:adapter_saves]
    # --8<-- [start:adapter_gathered]
    state_dict = accelerator.get_state_dict(engine)  # every rank: a collective
    if rank() == 0:
        model.save_pretrained(folders["get_state_dict"], state_dict=state_dict)
    # --8<-- [end:adapter_gathered]
    # --8<-- [start:adapter_fix]
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA, modules_to_save
    with deepspeed.zero.GatheredParameters(trained):  # every rank
        if rank() == 0:
            model.save_pretrained(folders["gathered"])
    # --8<-- [end:adapter_fix]
    trainer.save_model(folders["save_model"])
    return {name: {"folder": path} for name, path in folders.items()}


def tensors_in(folder):
    """Every tensor of every weights file in the folder: {file: {name: shape}}."""
    found = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            found[name] = safetensors.torch.load_file(path)
        elif name in ("model.pt", "pytorch_model.bin", "adapter_model.bin"):
            found[name] = torch.load(path, weights_only=True)
    return {name: {key: tuple(t.shape) for key, t in tensors.items()}
            for name, tensors in found.items()}


def recover_full(directory, checkpoint):
    """The full model from the DeepSpeed checkpoint save_model wrote with the setting off."""
    # --8<-- [start:recover_full]
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    model = LlamaForCausalLM.from_pretrained(directory)  # one process: not partitioned
    model.load_state_dict(state_dict)
    recovered = tempfile.mkdtemp(prefix="recovered-")
    model.save_pretrained(recovered)
    # --8<-- [end:recover_full]
    return recovered


def recover_adapter(directory, checkpoint):
    """An adapter from the DeepSpeed checkpoint Trainer wrote at the last step."""
    # --8<-- [start:recover_adapter]
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint)  # trained tensors
    model = get_peft_model(LlamaForCausalLM.from_pretrained(directory), LoraConfig(**LORA))
    loaded = model.load_state_dict(state_dict, strict=False)
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    recovered = tempfile.mkdtemp(prefix="recovered-adapter-")
    model.save_pretrained(recovered)
    # --8<-- [end:recover_adapter]
    return recovered, sorted(state_dict)


def load_full(directory, folder):
    """A full-model save, loaded in one process the way its file is meant to be loaded."""
    if os.path.exists(os.path.join(folder, "model.pt")):
        model = LlamaForCausalLM.from_pretrained(directory)
        model.load_state_dict(torch.load(os.path.join(folder, "model.pt"), weights_only=True))
        return model
    return LlamaForCausalLM.from_pretrained(folder)


def load_adapter(directory, folder):
    base = LlamaForCausalLM.from_pretrained(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's note on tied weights
        if os.path.exists(os.path.join(folder, "adapter.safetensors")):
            model = get_peft_model(base, LoraConfig(**LORA))
            tensors = safetensors.torch.load_file(os.path.join(folder, "adapter.safetensors"))
            set_peft_model_state_dict(model, tensors)
            return model  # pragma: no cover (the one file saved so is empty: this raises)
        return PeftModel.from_pretrained(base, folder)


REPORT_LINE = re.compile(r"(\S+) \| (MISMATCH \| Reinit due to size mismatch - ckpt: "
                         r"torch.Size\(\[0\]\) vs model:torch.Size\(\[[\d, ]+\]\))")


def loaded(row, load, want):
    """Load a save in this process: its logits against the trained model's, or the error."""
    got, logged = {}, Warnings()  # Transformers' load report
    logger = transformers.logging.get_logger("transformers")
    logger.addHandler(logged)
    error = error_text(lambda: got.update(model=load()))
    logger.removeHandler(logged)
    row["load error"] = error and error.replace(row["folder"], "<folder>")
    # Transformers' load report: one line per tensor, "key | MISMATCH | Reinit due to ..."
    row["report"] = dict(sorted(
        REPORT_LINE.findall(" ".join(logged.messages).replace("\x1b[1m", "").replace(
            "\x1b[0m", ""))))
    if row["load error"] is None:
        model = got["model"]
        with torch.no_grad():
            row["logits"] = model(input_ids=want["inputs"]).logits
        limit = 64 * torch.finfo(torch.float32).eps * want["logits"].abs().max()
        row["equal"] = bool((row["logits"] - want["logits"]).abs().max() <= limit)
        embed = model.get_input_embeddings()
        row["tied"] = model.get_output_embeddings().weight is embed.weight


def main():
    world_size = int(os.environ["WORLD_SIZE"])
    directory = save_tiny_llama()
    trainer = train(directory, world_size, gather_on_save=True, adapter=False)
    results = {"full": full_model_saves(trainer)}
    want = {"full": {"logits": trained_logits(trainer)}}
    results["full"]["after an evaluation"] = {"folder": shared_folder("save-")}
    if rank() == 0:  # the same plain save, now that a forward in eval mode ran
        trainer.model.save_pretrained(results["full"]["after an evaluation"]["folder"])
    trainer = train(directory, world_size, gather_on_save=False, adapter=False)
    results["full, gather off"] = gather_off_saves(trainer)
    want["full, gather off"] = {"logits": trained_logits(trainer)}
    trainer = train(directory, world_size, gather_on_save=True, adapter=True)
    results["adapter"] = adapter_saves(trainer)
    results["adapter"]["checkpoint"] = os.path.join(trainer.args.output_dir,
                                                    f"checkpoint-{STEPS}")
    want["adapter"] = {"logits": trained_logits(trainer)}
    trainer = train(directory, world_size, gather_on_save=False, adapter=True)
    results["adapter, gather off"] = {"save_model": {"folder": shared_folder("save-")}}
    trainer.save_model(results["adapter, gather off"]["save_model"]["folder"])
    want["adapter, gather off"] = {"logits": trained_logits(trainer)}
    fresh_accelerate_state()
    transformers.integrations.deepspeed.unset_hf_deepspeed_config()  # one process from here
    inputs = torch.stack([example["input_ids"] for example in token_dataset()])
    for case in want.values():
        case["inputs"] = inputs
    if rank() == 0:
        off = results["full, gather off"]["save_model"]["folder"]
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its progress
            results["full, gather off"]["recovered"] = {"folder": recover_full(directory, off)}
            folder, keys = recover_adapter(directory, results["adapter"]["checkpoint"])
        results["adapter"]["recovered"] = {"folder": folder, "checkpoint keys": keys}
        for case, rows in results.items():
            load = load_adapter if case.startswith("adapter") else load_full
            for name, row in rows.items():
                if not isinstance(row, dict) or "folder" not in row:
                    continue
                row["tensors"] = tensors_in(row["folder"])
                row["files"] = sorted(os.listdir(row["folder"]))
                loaded(row, lambda: load(directory, row["folder"]), want[case])
        print_table(results)
    torch.distributed.barrier()
    return {"results": results, "want": want}


ROWS = {  # (case, save): what the table calls it
    ("full", "state_dict"): "`torch.save(model.state_dict(), path)`, rank 0",
    ("full", "save_pretrained"): "`model.save_pretrained(folder)`, rank 0",
    ("full", "save_pretrained .bin"):
        "`model.save_pretrained(folder, safe_serialization=False)`, rank 0",
    ("full", "after an evaluation"):
        "`model.save_pretrained(folder)`, rank 0, after a forward in eval mode",
    ("full", "get_state_dict"):
        "`accelerator.get_state_dict(engine)`, then `save_pretrained(folder, state_dict=...)`",
    ("full", "gathered"): "`torch.save(model.state_dict(), path)` in `GatheredParameters`",
    ("full", "save_model"): "`trainer.save_model(folder)`",
    ("full, gather off", "save_model"): "`trainer.save_model(folder)`, gather setting off",
    ("full, gather off", "get_state_dict"): "`accelerator.get_state_dict(engine)`, setting off",
    ("full, gather off", "recovered"):
        "`get_fp32_state_dict_from_zero_checkpoint(folder)` on that folder, in one process",
    ("adapter", "save_pretrained"): "`model.save_pretrained(folder)`, rank 0",
    ("adapter", "get_peft_model_state_dict"):
        "`save_file(get_peft_model_state_dict(model), path)`, rank 0",
    ("adapter", "get_state_dict"):
        "`accelerator.get_state_dict(engine)`, then `save_pretrained(folder, state_dict=...)`",
    ("adapter", "gathered"): "`model.save_pretrained(folder)` in `GatheredParameters`",
    ("adapter", "save_model"): "`trainer.save_model(folder)`",
    ("adapter, gather off", "save_model"): "`trainer.save_model(folder)`, gather setting off",
    ("adapter", "recovered"):
        "`get_fp32_state_dict_from_zero_checkpoint` on `checkpoint-3`, in one process",
}


def first_clauses(message, count=1):
    """A long load error cut after its first clause, with how many it had."""
    clauses = message.split(". size mismatch for ")
    if len(clauses) <= count:
        return message
    return ". size mismatch for ".join(clauses[:count]) + f". ... ({len(clauses)} in all)"


def print_table(results):
    notes, empty_names = [], {}

    def note(message):
        if message not in notes:
            notes.append(message)
        return f"({chr(ord('a') + notes.index(message))})"

    heading = None
    for (case, name), label in ROWS.items():
        row = results[case][name]
        model = "adapter" if case.startswith("adapter") else "tied LM"
        if model != heading:
            heading = model
            print({"tied LM": "The tied causal LM:", "adapter": "\nThe LoRA adapter:"}[model])
            print()
            print("| Save | Wrote | Tensors of size 0 | Loaded in one process |")
            print("| --- | --- | --- | --- |")
        if "raised" in row:
            print(f"| {label} | nothing: raises {note(row['raised'])} | | |")
            continue
        written = [f for f in row["files"] if f.endswith((".safetensors", ".pt", ".bin"))
                   and f != "training_args.bin"] or [f for f in row["files"]
                                                     if f.startswith("global_step")]
        empty = sorted(key for tensors in row["tensors"].values()
                       for key, shape in tensors.items() if shape == (0,))
        total = sum(len(tensors) for tensors in row["tensors"].values())
        if empty:
            empty_names[model] = empty
        size_0 = (f"**all {total}**" if empty and len(empty) == total
                  else ", ".join(f"`{key}`" for key in empty) or ("none" if total else ""))
        if row["load error"]:
            outcome = f"**fails** {note(first_clauses(row['load error']))}"
        else:
            tied = ", head is embedding" if row["tied"] else ""
            outcome = ("logits equal the trained model's" if row["equal"]
                       else "**logits differ**") + tied
        files = ", ".join(f"`{f}`" for f in written) or "no weights"
        print(f"| {label} | {files} | {size_0} | {outcome} |")
    print()
    for model, names in empty_names.items():
        print(f"The tensors of size 0 ({model}): {', '.join(code(n) for n in names)}.")
        print()
    report = results["full"]["save_pretrained"]["report"]
    for index, message in enumerate(notes):
        mark = chr(ord("a") + index)
        print(f"- ({mark}) {code(message)}")
        if results["full"]["save_pretrained"]["load error"] == message and report:
            print(f"  Before it, `from_pretrained` logs a report with a line for each of the "
                  f"{len(report)} tensors, such as "
                  f"{code('model.embed_tokens.weight | ' + report['model.embed_tokens.weight'])}.")


def code(text):
    """Text as one Markdown code span, whatever backticks it holds."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence, pad = "`" * (longest + 1), " " if longest else ""
    return f"{fence}{pad}{text}{pad}{fence}"


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
