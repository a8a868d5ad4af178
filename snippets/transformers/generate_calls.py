"""generate() under ZeRO-3 where the ranks call it a different number of times: samples for a
log generated on rank 0 alone, and an evaluation set split unevenly over the ranks (one call
per prompt of the rank's own share). synced_gpus keeps the ranks in step inside one call of
generate(); it cannot make a rank call it.
rank_zero_only() and own_share_only(): the two hangs. main(): every rank calls generate() as
often as the others (the fixes), on two evaluation sets. The functions that hang (these two
and the ones they call) run only in runs the runner kills, whose ranks record no lines for the
suite's coverage gate (hence their pragmas).

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/generate_calls.py
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

VOCAB, PROMPT, NEW, SEED = 32, 3, 4, 0
EVALUATION_SETS = (5, 1)  # prompts in each set: 5 over 2 ranks is 3 and 2; 1 is 1 and 0


def tiny_llama():
    """A tied Llama small enough for a test, built from its config (no download)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def partitioned_model():
    """The model under ZeRO-3, in an engine without optimizer (as for evaluation)."""
    # Saved before the process group exists: save_pretrained writes on rank 0 only after.
    directory = tempfile.mkdtemp(prefix="tiny-llama-")
    tiny_llama().save_pretrained(directory)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    hf_config = HfDeepSpeedConfig(config)  # alive, as under Trainer: synced_gpus is on
    model = LlamaForCausalLM.from_pretrained(directory)  # partitioned
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    shutil.rmtree(directory)
    return engine.module, hf_config


def evaluation_set(size):
    generator = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, VOCAB, (1, PROMPT), generator=generator) for _ in range(size)]


def own_share(prompts):
    """This rank's contiguous share, without padding: the first ranks get one more."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    size, extra = divmod(len(prompts), world)
    start = rank * size + min(rank, extra)
    return prompts[start:start + size + (rank < extra)]


def greedy(model, prompt):
    prompt = prompt.to(get_accelerator().current_device_name())
    output = model.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return output[0, PROMPT:].tolist()


# --8<-- [start:hangs]
def log_samples_on_rank_zero(model):  # hangs  # pragma: no cover
    if torch.distributed.get_rank() == 0:
        print(f"sample: {greedy(model, evaluation_set(1)[0])}", flush=True)
    torch.distributed.barrier()  # what comes next on every rank: here, a barrier


def evaluate_own_share(model, prompts):  # uneven: hangs  # pragma: no cover
    outputs = [greedy(model, prompt) for prompt in own_share(prompts)]
    print(f"[rank {torch.distributed.get_rank()}] {len(outputs)} prompts", flush=True)
    torch.distributed.barrier()
    return outputs
# --8<-- [end:hangs]


# --8<-- [start:fixes]
def log_samples(model):
    tokens = greedy(model, evaluation_set(1)[0])  # every rank generates
    if torch.distributed.get_rank() == 0:
        print(f"sample: {tokens}")
    return tokens


def evaluate(model, prompts):
    mine = own_share(prompts)
    calls = torch.tensor(len(mine))  # every rank makes as many calls as the busiest
    torch.distributed.all_reduce(calls, op=torch.distributed.ReduceOp.MAX)
    padded = mine + [prompts[0]] * (int(calls) - len(mine))  # padding: outputs dropped
    return [greedy(model, prompt) for prompt in padded][:len(mine)]
# --8<-- [end:fixes]


def main():
    model, hf_config = partitioned_model()
    rank = torch.distributed.get_rank()
    results = {"log": log_samples(model)}
    for size in EVALUATION_SETS:
        results[size] = outputs = evaluate(model, evaluation_set(size))
        print(f"[rank {rank}] {len(outputs)} of {size} prompts: {outputs}")
    return results


def rank_zero_only():  # pragma: no cover (it hangs on purpose; killed ranks write no coverage)
    model, hf_config = partitioned_model()
    log_samples_on_rank_zero(model)


def own_share_only():  # pragma: no cover (it hangs on purpose)
    model, hf_config = partitioned_model()
    return evaluate_own_share(model, evaluation_set(EVALUATION_SETS[0]))


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
