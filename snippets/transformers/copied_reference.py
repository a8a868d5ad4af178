"""A reference model made by copying the trained one under ZeRO-3: TRL's
create_reference_model, and copy.deepcopy before and after deepspeed.initialize. Then the
reference loaded with from_pretrained and given its own engine, checked against one process.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/copied_reference.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import copy
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import deepspeed
import torch
import transformers
import trl
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig
from trl.experimental.utils import create_reference_model

VOCAB, SEQ, BATCH, SEED = 32, 6, 4, 0


def tiny_llama():
    """A tied Llama small enough for a test, built from its config (no download)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=True)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def batch():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def error_of(call):
    """The error `call` raises and the function that raised it, or None."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what the case shows
        where = traceback.extract_tb(error.__traceback__)[-1]
        return f"{type(error).__name__}: {error}", f"{where.name} ({Path(where.filename).name})"
    return None  # pragma: no cover (every case shown raises)


def main():
    directory = tempfile.mkdtemp(prefix="tiny-llama-")  # the checkpoint both are loaded from
    tiny_llama().save_pretrained(directory)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    say(f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}")
    config = {"train_micro_batch_size_per_gpu": BATCH,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    tokens = batch().to(get_accelerator().current_device_name())
    results = {}

    # --8<-- [start:copies]
    hf_config = HfDeepSpeedConfig(config)  # ZeRO-3 configured, as under Trainer
    policy = LlamaForCausalLM.from_pretrained(directory)  # partitioned
    results["create_reference_model"] = error_of(lambda: create_reference_model(policy))

    reference = copy.deepcopy(policy)  # before deepspeed.initialize
    weight = reference.model.embed_tokens.weight
    results["copy: weight"] = (tuple(weight.shape), hasattr(weight, "ds_status"))
    results["copy: forward"] = error_of(lambda: reference(tokens))

    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config)
    reference = copy.deepcopy(engine.module)  # after it: the hooks are copied too
    results["copy after initialize: forward"] = error_of(lambda: reference(tokens))
    results["policy after the copy: forward"] = error_of(lambda: engine(tokens))
    # --8<-- [end:copies]
    say("create_reference_model(policy): {}, raised in {}".format(*results["create_reference_model"]))
    say("copy.deepcopy(policy) before initialize: embed_tokens.weight shape {}, "
        "has ds_status: {}".format(*results["copy: weight"]))
    say("  its forward: {}, raised in {}".format(*results["copy: forward"]))
    say("copy.deepcopy(engine.module) after initialize, its forward: {}, raised in {}".format(
        *results["copy after initialize: forward"]))
    say("  then the policy's own forward: {}, raised in {}".format(
        *results["policy after the copy: forward"]))

    # --8<-- [start:loaded]
    reference = LlamaForCausalLM.from_pretrained(directory)  # the same checkpoint, partitioned
    reference_engine, *_ = deepspeed.initialize(model=reference, config=config)
    reference_engine.eval()
    with torch.no_grad():
        logits = reference_engine(tokens).logits
    # --8<-- [end:loaded]
    results["loaded: logits"] = logits.cpu()
    say(f"reference loaded with from_pretrained, own engine: largest |logit| "
        f"{logits.abs().max().item():.4f}")
    del hf_config
    shutil.rmtree(directory, ignore_errors=True)
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
