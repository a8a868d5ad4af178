"""A tied Transformers model (LlamaForCausalLM, tie_word_embeddings=True) built without
memory, sharded with FSDP2 (fully_shard), materialized with to_empty() and filled from the
file save_pretrained wrote: torch.device("meta") against accelerate's init_empty_weights(),
the file's missing lm_head.weight, and tie_weights().

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/fsdp_meta_init_llama.py
(DS_ACCELERATOR is not used here; the command is that of the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import transformers
from accelerate import init_empty_weights
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, set_model_state_dict)
from torch.distributed.fsdp import fully_shard

VOCAB, SEQ, BATCH, STEPS, SEED, LR = 64, 8, 8, 3, 0, 0.5


def this_ranks_device():
    """The CPU here (then gloo); with an accelerator (not run here), LOCAL_RANK's."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type,
                            torch.accelerator.current_device_index())
    return torch.device("cpu")


def tiny_llama():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=True)


def batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def tied(model):
    return model.lm_head.weight is model.model.embed_tokens.weight


# --8<-- [start:build]
def build(device, empty_context, tie_again=False):
    with empty_context():
        model = transformers.LlamaForCausalLM(tiny_llama())
    built_tied = tied(model)
    if tie_again:
        model.tie_weights()  # lm_head.weight = embed_tokens.weight again
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # the root group: both embeddings, the norm
    model.to_empty(device=device)
    # to_empty() leaves buffers uninitialized too, and RoPE's inv_freq is in
    # no state dict: compute it again
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(model.config).to(device)
    return model, built_tied


def load(model, path):
    """Rank 0 reads the file; every rank receives its shards."""
    state = load_file(path) if dist.get_rank() == 0 else {}
    if state and model.config.tie_word_embeddings:
        # the file stores the tied weight once: name it for lm_head too
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)
# --8<-- [end:build]


def meta_device():
    return torch.device("meta")


CASES = {
    'torch.device("meta")': dict(empty_context=meta_device),
    "init_empty_weights()": dict(empty_context=init_empty_weights),
    "init_empty_weights(), tie_weights()": dict(empty_context=init_empty_weights,
                                               tie_again=True),
}


def train(model, device):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked there)")
    steps = []
    for step in range(STEPS):
        tokens = batch(step)[rank::world].to(device)  # data parallel: this rank's share
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone())
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        steps.append({"loss": mean.item() / world, "one Parameter": head is embed,
                      "gap": (embed.full_tensor() - head.full_tensor())
                      .abs().max().item()})
    weights = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return {"steps": steps, "weights": weights,
            "head": model.lm_head.weight.full_tensor().detach()}


def saved_in_one_process(where):
    """The checkpoint to start from, written by rank 0: what save_pretrained
    stores for a tied model."""
    torch.manual_seed(SEED)
    transformers.LlamaForCausalLM(tiny_llama()).save_pretrained(where)
    path = f"{where}/model.safetensors"
    return path, sorted(k for k in load_file(path) if "embed" in k or "head" in k)


def strict_load_of_the_file(path, device):
    model, _ = build(device, meta_device)
    state = load_file(path) if dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    try:
        set_model_state_dict(model, state, options=options)
    except RuntimeError as error:
        return f"RuntimeError: {error}"


def main():
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)  # one folder, rank 0's
    saved = [None]
    if dist.get_rank() == 0:
        saved = [saved_in_one_process(where[0])]
    dist.broadcast_object_list(saved)
    path, keys = saved[0]
    results = {}
    for name, case in CASES.items():
        model, built_tied = build(device, **case)
        load(model, path)
        results[name] = {"built tied": built_tied, "tied after load": tied(model),
                         **train(model, device)}
    refused = strict_load_of_the_file(path, device)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where[0])
        print(f"save_pretrained wrote: {keys}")
        for name, got in results.items():
            print(f"{name}: built tied {got['built tied']}, "
                  f"tied after load {got['tied after load']}")
            for step, s in enumerate(got["steps"]):
                print(f"  step {step}: loss {s['loss']:.4f}, lm_head is embed_tokens "
                      f"{s['one Parameter']}, max |embed - head| {s['gap']:.4f}")
        print(f"strict load of the file: {refused}")
    dist.destroy_process_group()
    return {"keys": keys, "results": results, "refused": refused}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
