"""A tied Llama trained with FSDP2, saved with save_pretrained from the gathered full state
dict: the gather gives each name a tensor of its own, so the file holds the tied weight twice.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/fsdp_save_both_names.py
(DS_ACCELERATOR is not used here; the command is the one of the DeepSpeed examples.)
Run and tested here on CPU only, over gloo, with torch 2.13.0, transformers 5.24.0 and
megatron-core 0.16.1, on 2 and 4 processes; not run on GPUs.
"""
import os
import shutil
import sys
import tempfile

import safetensors.torch
import torch
import torch.distributed as dist
import transformers
from convert_tied_megatron import (SEED, SEQ, VOCAB, error, hf_to_megatron,
                                   load_megatron, megatron_gpt, tied_hf_to_megatron,
                                   tiny_llama_config)
from megatron.core import parallel_state
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import LlamaForCausalLM

BATCH, STEPS, LR = 4, 3, 0.5


def batch():
    """The same tokens on every rank, step and run."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


# --8<-- [start:train]
def train():
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(tiny_llama_config(tie=True))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # the root group: the embedding and the head, one Parameter
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tokens, losses = batch(), []
    for _ in range(STEPS):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses
# --8<-- [end:train]


def saved_keys(folder):
    names = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    return sorted(name for name in names if "embed" in name or "head" in name)


def logits_of(model):
    with torch.no_grad():
        return model(input_ids=batch()).logits


def main():
    dist.init_process_group()  # no backend named: gloo for CPU tensors
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1)
    transformers.logging.disable_progress_bar()
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *args: None)
    model, losses = train()
    say("losses: " + " ".join(f"{loss:.4f}" for loss in losses))
    say("after fully_shard and training, lm_head.weight is embed_tokens.weight: "
        f"{model.lm_head.weight is model.model.embed_tokens.weight}")
    trained = logits_of(model)
    workdir = [tempfile.mkdtemp(prefix="fsdp-save-") if rank == 0 else None]
    dist.broadcast_object_list(workdir)
    both_names, one_name = (os.path.join(workdir[0], name) for name in ("both", "one"))
    results = {"losses": losses, "logits": trained,
               "trained_tied": model.lm_head.weight is model.model.embed_tokens.weight}

    # --8<-- [start:save]
    full = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))  # every rank takes part; rank 0 gets it
    if rank == 0:
        embedding, head = full["model.embed_tokens.weight"], full["lm_head.weight"]
        print(f"full state dict: one storage: {embedding.data_ptr() == head.data_ptr()}, "
              f"equal: {torch.equal(embedding, head)}")
        with torch.device("meta"):  # a model to save with, without weights of its own
            shell = LlamaForCausalLM(tiny_llama_config(tie=True))
        shell.save_pretrained(both_names, state_dict=full)
        print(f"save_pretrained(state_dict=full) wrote {saved_keys(both_names)}")
    # --8<-- [end:save]
    dist.barrier()
    # --8<-- [start:reload]
    reloaded = LlamaForCausalLM.from_pretrained(both_names)
    tied = reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    say(f"from_pretrained: lm_head.weight is embed_tokens.weight: {tied}")
    file = safetensors.torch.load_file(os.path.join(both_names, "model.safetensors"))
    refused = error(lambda: load_megatron(megatron_gpt(True), hf_to_megatron(file)))
    say(f"the file mapped for a tied Megatron GPTModel, strict load: {refused}")
    # --8<-- [end:reload]
    results.update(reloaded_tied=tied, reloaded_logits=logits_of(reloaded),
                   refused=refused, both_keys=saved_keys(both_names))
    results["tied mapping"] = str(load_megatron(
        megatron_gpt(True), tied_hf_to_megatron(file, reloaded.config, True)))

    # --8<-- [start:fix]
    full = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    one_name_each = dict(model.named_parameters())  # a tied weight under its first name
    aliases = [name for name, _ in model.named_parameters(remove_duplicate=False)
               if name not in one_name_each]
    if rank == 0:
        for name in aliases:
            del full[name]
        with torch.device("meta"):
            shell = LlamaForCausalLM(tiny_llama_config(tie=True))
        shell.save_pretrained(one_name, state_dict=full)
        print(f"without {aliases}: save_pretrained wrote {saved_keys(one_name)}")
    # --8<-- [end:fix]
    dist.barrier()
    fixed = LlamaForCausalLM.from_pretrained(one_name)
    results.update(aliases=aliases, one_keys=saved_keys(one_name), fixed_logits=logits_of(fixed),
                   fixed_tied=fixed.lm_head.weight is fixed.model.embed_tokens.weight)
    say(f"from_pretrained: lm_head.weight is embed_tokens.weight: {results['fixed_tied']}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(workdir[0])
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
