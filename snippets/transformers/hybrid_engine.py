"""DeepSpeed-Chat's hybrid engine ("hybrid_engine": {"enabled": true}) under ZeRO-3, on CPU:
deepspeed.initialize for tiny OPT, GPT-2, Llama, BLOOM and Qwen2 models. The first four have
a DeepSpeed inference policy, and building its inference containers stops on CPU; Qwen2 has
none, so the engine keeps the model's own generate(), which is run here, followed by one
training step (tests/transformers/test_hybrid_engine.py compares both with one process).

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/hybrid_engine.py
Not run on GPUs, where the inference containers are built instead.
"""
import os
import shutil
import sys
import tempfile
import traceback

import deepspeed
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from transformers.integrations import HfDeepSpeedConfig

VOCAB, PROMPT, NEW_TOKENS, SEED, LR = 32, 4, 4, 0, 0.1
SIZES = dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2)
CONFIGS = {  # tiny configs (no download) of the readers' model families, and Qwen2
    "OPTForCausalLM": transformers.OPTConfig(
        **SIZES, ffn_dim=32, num_hidden_layers=2, word_embed_proj_dim=16),
    "GPT2LMHeadModel": transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
        bos_token_id=None, eos_token_id=None),
    "LlamaForCausalLM": transformers.LlamaConfig(
        **SIZES, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2),
    "BloomForCausalLM": transformers.BloomConfig(vocab_size=VOCAB, hidden_size=16,
                                                 n_layer=2, n_head=2),
    "Qwen2ForCausalLM": transformers.Qwen2Config(
        **SIZES, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2),
}


def tiny_model(name):
    torch.manual_seed(SEED)
    return getattr(transformers, name)(CONFIGS[name])


def prompt():
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(1, VOCAB, (1, PROMPT), generator=generator)


# --8<-- [start:config]
def ds_config():
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "hybrid_engine": {"enabled": True, "max_out_tokens": 16},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
# --8<-- [end:config]


def generate_and_train(engine):
    """What DeepSpeed-Chat's step 3 does with the actor: generate, then train on it."""
    # --8<-- [start:generate]
    engine.eval()
    with torch.no_grad():
        tokens = engine.module.generate(prompt().to(engine.device), do_sample=False,
                                        max_new_tokens=NEW_TOKENS, synced_gpus=True,
                                        pad_token_id=0)
    engine.train()
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    # --8<-- [end:generate]
    return tokens[0].tolist(), loss.item()


def main():
    # Saved before the process group exists: save_pretrained writes on rank 0 only after.
    folders = {}
    for name in CONFIGS:
        folders[name] = tempfile.mkdtemp(prefix="hybrid-engine-")
        tiny_model(name).save_pretrained(folders[name])
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    say = print if torch.distributed.get_rank() == 0 else (lambda *args, **kwargs: None)
    results = {}
    for name in CONFIGS:
        config = ds_config()
        hf_config = HfDeepSpeedConfig(config)  # alive: from_pretrained partitions
        model = getattr(transformers, name).from_pretrained(folders[name])
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        try:
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        except (ValueError, RuntimeError) as error:
            raised = f"{type(error).__name__}: {error}"
            say(f"{name}: deepspeed.initialize raised {raised}", flush=True)
            frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
            results[name] = {"raised": raised, "frames": frames}
            continue
        say(f"{name}: {type(engine).__name__} with "
            f"{len(engine._inference_containers)} inference containers", flush=True)
        tokens, loss = generate_and_train(engine)
        results[name] = {"tokens": tokens, "loss": loss}
        say(f"  generated {tokens}, then a step with loss {loss:.4f}", flush=True)
    for folder in folders.values():
        shutil.rmtree(folder)
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
