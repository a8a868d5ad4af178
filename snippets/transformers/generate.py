"""generate() under ZeRO-3 on several ranks, where the ranks stop after different numbers
of new tokens (a length limit here; an end-of-sequence token does the same).
main(): synced_gpus left to Transformers, and set to True. unsynced(): synced_gpus=False.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/generate.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import shutil
import sys
import tempfile

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig

VOCAB, PROMPT, SEED = 32, 3, 0


def tiny_llama():
    """A tied Llama small enough for a test, built from its config (no download)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def prompt(rank):
    generator = torch.Generator().manual_seed(rank)
    return torch.randint(0, VOCAB, (1, PROMPT), generator=generator)


def new_tokens(rank):
    return 2 + 3 * rank  # rank 0 stops first


def partitioned_model():
    """The model under ZeRO-3, in an engine without optimizer (as for evaluation)."""
    # Saved before the process group exists: save_pretrained writes on rank 0 only after.
    directory = tempfile.mkdtemp(prefix="tiny-llama-")
    tiny_llama().save_pretrained(directory)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    hf_config = HfDeepSpeedConfig(config)  # alive, as under Trainer
    model = LlamaForCausalLM.from_pretrained(directory)  # partitioned
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    shutil.rmtree(directory)
    return engine.module, hf_config


def generate(model, **kwargs):
    rank = torch.distributed.get_rank()
    tokens = prompt(rank).to(get_accelerator().current_device_name())
    # --8<-- [start:generate]
    output = model.generate(tokens, max_new_tokens=new_tokens(rank), do_sample=False,
                            pad_token_id=0, **kwargs)
    # --8<-- [end:generate]
    return output[0, PROMPT:].tolist()


def main():
    model, hf_config = partitioned_model()
    rank = torch.distributed.get_rank()
    results = {"default": generate(model), "synced": generate(model, synced_gpus=True)}
    print(f"[rank {rank}] synced_gpus left to Transformers: {results['default']}")
    print(f"[rank {rank}] synced_gpus=True: {results['synced']}")
    return results


# --8<-- [start:unsynced]
def unsynced():  # pragma: no cover (it hangs on purpose; killed ranks write no coverage)
    model, hf_config = partitioned_model()
    rank = torch.distributed.get_rank()
    tokens = generate(model, synced_gpus=False)
    print(f"[rank {rank}] synced_gpus=False: {tokens}", flush=True)
    torch.distributed.barrier()  # what comes next on every rank: here, a barrier
    return tokens
# --8<-- [end:unsynced]


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
