"""resize_token_embeddings on a tied causal LM under ZeRO-3: the orders that work (before
deepspeed.initialize, with HfDeepSpeedConfig alive) and those that fail.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/resize_embeddings.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from transformers import LlamaConfig, LlamaForCausalLM
try:
    from transformers.integrations import HfDeepSpeedConfig
except ImportError:  # pragma: no cover - before Transformers 4.32 (the version matrix's 4.31.0)
    from transformers.deepspeed import HfDeepSpeedConfig

VOCAB, ADDED, SEQ, BATCH, STEPS, SEED, LR = 32, 4, 6, 8, 3, 0, 0.1
PAD_TO = 8  # 36 rows padded to 40


def tiny_llama(tied=True):
    """A Llama small enough for a test, built from its config (no download); tied unless
    `tied=False` (then the head has weights of its own, resized separately)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=tied)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def batch():
    """Tokens that use the added ids too, so their rows train."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, VOCAB + ADDED, (BATCH, SEQ), generator=generator)


def ds_config(world_size):
    return {
        "train_micro_batch_size_per_gpu": BATCH // world_size,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }


def tied(model):
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def full_weight(weight):
    with deepspeed.zero.GatheredParameters(weight):  # a no-op for a weight not partitioned
        return weight.detach().clone()


def facts(model):
    weight = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return {"tied": tied(model), "partitioned": hasattr(weight, "ds_id"),
            "shape": tuple(getattr(weight, "ds_shape", weight.shape)),
            "head shape": tuple(getattr(head, "ds_shape", head.shape)),
            "vocab_size": model.config.vocab_size, "embedding": full_weight(weight),
            "head": full_weight(head)}


def train(engine):
    """STEPS steps on this rank's share of the batch; losses and full gradients."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tokens = batch()[rank::world].to(engine.device)
    losses, grads = [], []
    for _ in range(STEPS):
        # The model's own loss, as Trainer computes it: it reshapes the logits by
        # config.vocab_size (that is where a vocab_size of 0 fails).
        loss = engine(tokens, labels=tokens).loss
        engine.backward(loss)
        grads.append({name: safe_get_full_grad(p).clone()
                      for name, p in engine.module.named_parameters()})
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "grads": grads}


def all_ranks(flag):
    """Whether `flag` holds on every rank (a collective)."""
    flags = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(flags, bool(flag))
    return all(flags)


def say_resized(label, result):
    if torch.distributed.get_rank() != 0:
        return
    for when in ("resized", "initialized"):
        print(f"{label}, {when}:", *(f"{k} {v}," for k, v in result[when].items()
                                     if k not in ("embedding", "head")))
    print("  losses:", *(f"{x:.4f}" for x in result["losses"]))


def initialize(model, config):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def error_of(call):
    """The error `call` raises, and the function that raised it; printed, not raised, so
    that one launch shows every case."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what the case shows
        where = traceback.extract_tb(error.__traceback__)[-1]
        return f"{type(error).__name__}: {error}", f"{where.name} ({Path(where.filename).name})"
    return None  # pragma: no cover (every case shown raises)


def main():
    # Saved before the process group exists: save_pretrained writes on rank 0 only after.
    directory = tempfile.mkdtemp(prefix="tiny-llama-")
    tiny_llama().save_pretrained(directory)
    untied_directory = tempfile.mkdtemp(prefix="tiny-llama-untied-")
    tiny_llama(tied=False).save_pretrained(untied_directory)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    config = ds_config(world)
    results = {}

    # --8<-- [start:before]
    hf_config = HfDeepSpeedConfig(config)  # alive, as under Trainer: ZeRO-3 is configured
    model = LlamaForCausalLM.from_pretrained(directory)  # inside zero.Init: partitioned
    model.resize_token_embeddings(VOCAB + ADDED)  # before deepspeed.initialize
    resized = facts(model)  # tied? partitioned? (printed below)
    engine = initialize(model, config)
    # --8<-- [end:before]
    results["before"] = {"resized": resized, "initialized": facts(model)}
    for when in ("resized", "initialized"):  # printed before training, which can fail
        say(f"{when}:", *(f"{k} {v}," for k, v in results["before"][when].items()
                          if k not in ("embedding", "head", "head shape")))
    results["before"].update(train(engine))
    say("  losses:", *(f"{x:.4f}" for x in results["before"]["losses"]))

    # --8<-- [start:outside]
    del hf_config
    model = LlamaForCausalLM.from_pretrained(directory)  # outside zero.Init: full
    hf_config = HfDeepSpeedConfig(config)
    model.resize_token_embeddings(VOCAB + ADDED)
    resized = facts(model)
    engine = initialize(model, config)  # partitions the resized model
    # --8<-- [end:outside]
    results["outside"] = {"resized": resized, **train(engine)}
    say("built outside zero.Init, resized, then initialized: losses",
        *(f"{x:.4f}" for x in results["outside"]["losses"]))

    # --8<-- [start:padded]
    model = LlamaForCausalLM.from_pretrained(directory)
    model.resize_token_embeddings(VOCAB + ADDED, pad_to_multiple_of=PAD_TO)
    resized = facts(model)
    engine = initialize(model, config)
    # --8<-- [end:padded]
    results["padded"] = {"resized": resized, "initialized": facts(model), **train(engine)}
    say_resized(f"pad_to_multiple_of={PAD_TO}", results["padded"])

    # --8<-- [start:unseeded]
    model = LlamaForCausalLM.from_pretrained(directory)
    torch.manual_seed(SEED + torch.distributed.get_rank())  # each rank its own draws
    model.resize_token_embeddings(VOCAB + ADDED)
    resized = facts(model)
    engine = initialize(model, config)  # converts the new embedding: rank 0's values
    # --8<-- [end:unseeded]
    results["unseeded"] = {"resized": resized, "initialized": facts(model), **train(engine)}
    added = results["unseeded"]["resized"]["embedding"][VOCAB:]
    rank_0_added = added.clone()
    torch.distributed.broadcast(rank_0_added, src=0)
    after = results["unseeded"]["initialized"]["embedding"][VOCAB:]
    say("each rank seeded differently: added rows equal rank 0's before initialize:",
        all_ranks(torch.equal(added, rank_0_added)), "after:",
        all_ranks(torch.equal(after, rank_0_added)))
    say("  losses:", *(f"{x:.4f}" for x in results["unseeded"]["losses"]))

    # --8<-- [start:untied]
    model = LlamaForCausalLM.from_pretrained(untied_directory)  # its own head weights
    model.resize_token_embeddings(VOCAB + ADDED)  # resizes the head too
    resized = facts(model)
    engine = initialize(model, config)
    # --8<-- [end:untied]
    results["untied"] = {"resized": resized, "initialized": facts(model), **train(engine)}
    say_resized("untied head", results["untied"])

    # --8<-- [start:after]
    model = LlamaForCausalLM.from_pretrained(directory)
    engine = initialize(model, config)
    results["after"] = error_of(lambda: (engine.module.resize_token_embeddings(VOCAB + ADDED),
                                         train(engine)))
    # --8<-- [end:after]
    say("resized after deepspeed.initialize: {}, raised in {}".format(*results["after"]))

    # --8<-- [start:no_config]
    model = LlamaForCausalLM.from_pretrained(directory)  # partitioned
    del hf_config  # ZeRO-3 no longer configured: resize does not gather
    results["no_config"] = error_of(lambda: model.resize_token_embeddings(VOCAB + ADDED))
    # --8<-- [end:no_config]
    say("resized without HfDeepSpeedConfig: {}, raised in {}".format(*results["no_config"]))
    shutil.rmtree(directory)
    shutil.rmtree(untied_directory)
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
