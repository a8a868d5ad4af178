"""A tied Llama-shaped model (tie_word_embeddings=True) through accelerate's FSDP2 plugin with
its default auto-wrap (one group per decoder layer): how accelerate groups the tied weight,
training against one process, the tie after the steps, a save and a from_pretrained reload;
then a checkpoint whose config ties but whose file has both weights (accelerate issue #3870's
case), and Trainer's `fsdp` argument on CPU processes.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/accelerate_fsdp2_tied.py
(DS_ACCELERATOR is not used here; the command is that of the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import contextlib
import io
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

VOCAB, SEQ, BATCH, STEPS, SEED, LR = 64, 8, 4, 3, 0, 0.5


def tiny_llama(tie=True):
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=tie)


def batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


# --8<-- [start:accelerator]
def fsdp2_accelerator(**options):
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **options)
    on_cpu = not torch.accelerator.is_available()
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=on_cpu)
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        # accelerate turns FSDP on only with an accelerator: on CPU processes it
        # would wrap the model in DDP. These two lines make prepare() take its
        # FSDP2 path on the CPU too; with GPUs, leave them out.
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator
# --8<-- [end:accelerator]


def groups(model):
    """Each fully_shard group: the modules it was made for and the parameters it
    manages (a tied parameter under all its names)."""
    module_names = {id(m): n or "(root)" for n, m in model.named_modules()}
    param_names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(param), []).append(name)
    found, seen = [], set()
    for module in model.modules():
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        group = state._fsdp_param_group
        params = [" = ".join(param_names[id(p.sharded_param)])
                  for p in (group.fsdp_params if group else [])]
        found.append(([module_names[id(m)] for m in state._modules], params))
    return found


# --8<-- [start:train]
def train_steps(accelerator, model, optimizer):
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        # data parallel: this rank's share, on the device prepare() put the model on
        tokens = batch(step)[rank::world].to(accelerator.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    return losses


def train_and_reload():
    accelerator = fsdp2_accelerator()
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(tiny_llama())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = train_steps(accelerator, model, optimizer)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    tie = {"one Parameter": head is embed,
           "max |embed - head|": (embed.full_tensor() - head.full_tensor()).abs().max().item()}
    # What accelerator.get_state_dict does under FSDP2 (see the page): every rank takes
    # part, the main process gets the full tensors.
    full = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    reloaded = {}
    if accelerator.is_main_process:  # the full tensors are there
        where = tempfile.mkdtemp()
        plain = transformers.LlamaForCausalLM(tiny_llama())
        plain.load_state_dict(full)
        plain.save_pretrained(where)
        with safe_open(f"{where}/model.safetensors", "pt") as saved:
            reloaded["saved"] = sorted(k for k in saved.keys() if "embed" in k or "head" in k)
        plain = transformers.LlamaForCausalLM.from_pretrained(where)
        shutil.rmtree(where)
        reloaded["tied"] = plain.lm_head.weight is plain.model.embed_tokens.weight
        reloaded["weights"] = {n: p.detach() for n, p in plain.named_parameters()}
    return {"losses": losses, "tie": tie, "groups": groups(model), "reloaded": reloaded,
            "after prepare": after_prepare(accelerator, model)}
# --8<-- [end:train]


def after_prepare(accelerator, model):
    """Why the example gathers with get_model_state_dict itself on CPU: what the
    accelerator reports after prepare(), and what its get_state_dict returns."""
    state_dict = accelerator.get_state_dict(model)
    return {"distributed type": str(accelerator.distributed_type),
            "get_state_dict tensors": sorted({type(t).__name__ for t in state_dict.values()})}


# --8<-- [start:checkpoint]
def both_weights_in_the_file(untie_config=False):
    """A checkpoint whose file has lm_head.weight beside the embedding, loaded with
    tie_word_embeddings=True, under cpu_ram_efficient_loading."""
    accelerator = fsdp2_accelerator(cpu_ram_efficient_loading=True)
    where = [tempfile.mkdtemp() if accelerator.is_main_process else None]
    dist.broadcast_object_list(where)
    if accelerator.is_main_process:
        torch.manual_seed(SEED)
        transformers.LlamaForCausalLM(tiny_llama(tie=False)).save_pretrained(where[0])
    dist.barrier()
    model = transformers.LlamaForCausalLM.from_pretrained(
        where[0], tie_word_embeddings=True)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if untie_config:  # the fix: a config that says what the file holds
        model.config.tie_word_embeddings = False
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dist.barrier()
    if accelerator.is_main_process:
        shutil.rmtree(where[0])
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
    except (KeyError, ValueError) as error:
        return {"tied when loaded": tied, "prepared": f"{type(error).__name__}: {error}"}
    losses = train_steps(accelerator, model, optimizer)  # two weights, as in the file
    two = model.lm_head.weight is not model.model.embed_tokens.weight
    return {"tied when loaded": tied, "prepared": True, "losses": losses, "two weights": two}
# --8<-- [end:checkpoint]


# --8<-- [start:trainer]
def trainer_with_fsdp():
    """Trainer's own FSDP arguments, on these CPU processes."""
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(tiny_llama())
    args = transformers.TrainingArguments(
        tempfile.mkdtemp(), fsdp=True, fsdp_config={"version": 2}, use_cpu=True,
        max_steps=1, per_device_train_batch_size=2, report_to=[], save_strategy="no")
    data = [{"input_ids": tokens, "labels": tokens} for tokens in batch(0)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with contextlib.redirect_stdout(io.StringIO()):  # its timings, different each run
        trainer.train()
    shutil.rmtree(args.output_dir)
    return {"distributed type": str(trainer.accelerator.distributed_type),
            "FSDP": trainer.is_fsdp_enabled, "model": type(trainer.model_wrapped).__name__}
# --8<-- [end:trainer]


def main():
    transformers.logging.set_verbosity_error()
    trainer = trainer_with_fsdp()  # first: it sets up accelerate's state its own way
    result = train_and_reload()
    checkpoint = {"config ties": both_weights_in_the_file(),
                  "config unties": both_weights_in_the_file(untie_config=True)}
    if dist.get_rank() == 0:
        print("fully_shard groups: the modules, the parameters they manage")
        for modules, params in result["groups"]:
            held = ", ".join(params) if len(params) < 4 else f"{len(params)} parameters"
            print(f"  [{', '.join(modules)}]: {held or 'none'}")
        for step, loss in enumerate(result["losses"]):
            print(f"step {step}: loss {loss:.4f}")
        print("tie after the steps:", result["tie"])
        print("saved:", result["reloaded"]["saved"], "; reloaded with from_pretrained, "
              "lm_head.weight is embed_tokens.weight:", result["reloaded"]["tied"])
        for name, got in checkpoint.items():
            shown = {key: got[key] for key in ("tied when loaded", "prepared")}
            print(f"both weights in the file, {name}: {shown}")
            if "losses" in got:
                print(f"  trained: losses {' '.join(f'{x:.4f}' for x in got['losses'])}, "
                      f"lm_head and embed_tokens two Parameters: {got['two weights']}")
        print("Trainer(fsdp=True):", trainer)
    dist.destroy_process_group()
    return {**result, "checkpoint": checkpoint, "trainer": trainer}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
