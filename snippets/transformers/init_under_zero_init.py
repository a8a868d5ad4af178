"""Which weights keep the initialization their model asks for when the model is built
under ZeRO-3: each parameter of each model compared with the same model built without
DeepSpeed, same seed. A model of your own (and two ways to write its initialization), a
GPT-2 built with its constructor inside deepspeed.zero.Init, GPT-2 from from_config with an
HfDeepSpeedConfig, and a composite model (Gemma 3: a SigLIP vision tower and a Gemma 3 text
model) built both ways.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/init_under_zero_init.py
Run and tested here on CPU only; not run on GPUs.
"""
import math
import os
import sys

import deepspeed
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from torch import nn
from transformers import Gemma3ForConditionalGeneration, Gemma3Model, GPT2LMHeadModel
from transformers.integrations import HfDeepSpeedConfig

SEED, VOCAB, DIM = 0, 64, 16
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    # Partition even these tiny weights, as large ones are.
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}


# --8<-- [start:own]
class OwnInit(nn.Module):
    """A model of your own that initializes its weights in its constructor,
    module by module (as Transformers' _init_weights(module) does)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        self.init_weights()

    def init_weights(self):
        for module in self.modules():
            self.init_module(module)

    def init_module(self, module):
        # Under zero.Init the weights are already partitioned here: these write
        # into empty tensors.
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)


class GatheredInit(OwnInit):
    """Fix 1: gather one module's own weights at a time around its
    initialization; rank 0's values are sent to every rank when each block
    ends. Without zero.Init, GatheredParameters does nothing."""

    def init_weights(self):
        for module in self.modules():
            params = list(module.parameters(recurse=False))
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                self.init_module(module)
# --8<-- [end:own]


def tiny_gpt2_config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=DIM,
                                   n_layer=2, n_head=2, bos_token_id=VOCAB - 1,
                                   eos_token_id=VOCAB - 1)


def tiny_gemma3_config():
    """A composite model: a SigLIP vision tower, a projector, a Gemma 3 text model."""
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=32, sliding_window=8)
    vision = transformers.SiglipVisionConfig(
        hidden_size=DIM, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, image_size=16, patch_size=8)
    return transformers.Gemma3Config(text_config=text, vision_config=vision,
                                     mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                     boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)


# --8<-- [start:builds]
def inside_zero_init(build, hf_deepspeed_config=False):
    """Your own `with deepspeed.zero.Init():` around the model's constructor
    (with an HfDeepSpeedConfig alive, if asked)."""
    def built():
        zero3 = HfDeepSpeedConfig(DS_CONFIG) if hf_deepspeed_config else None  # noqa
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
            return build()
    return built


def from_config(config, auto=transformers.AutoModelForCausalLM):
    """No zero.Init of your own: from_config enters it while an HfDeepSpeedConfig
    holding a ZeRO-3 config is alive."""
    def built():
        zero3 = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841 (alive while from_config runs)
        return auto.from_config(config)
    return built


def partitioned_by_initialize(build):
    """Fix 2: build without ZeRO; deepspeed.initialize partitions the built model."""
    def built():
        model = build()
        engine, *_ = deepspeed.initialize(
            model=model, config=DS_CONFIG,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        return engine.module
    return built


# The classes are imported above, before any zero.Init: see "Transformers: first
# imports inside zero.Init".
gpt2 = lambda: GPT2LMHeadModel(tiny_gpt2_config())  # noqa: E731
gemma3 = lambda: Gemma3ForConditionalGeneration(tiny_gemma3_config())  # noqa: E731
gemma3_base = lambda: Gemma3Model(tiny_gemma3_config())  # noqa: E731
MODELS = {  # name: (how it is built under ZeRO-3, the same model without DeepSpeed)
    "OwnInit in zero.Init": (inside_zero_init(OwnInit), OwnInit),
    "GatheredInit in zero.Init": (inside_zero_init(GatheredInit), GatheredInit),
    "OwnInit, then initialize": (partitioned_by_initialize(OwnInit), OwnInit),
    "GPT2LMHeadModel(config) in zero.Init": (inside_zero_init(gpt2), gpt2),
    "the same, HfDeepSpeedConfig alive": (inside_zero_init(gpt2, True), gpt2),
    "GPT-2 from_config": (from_config(tiny_gpt2_config()), gpt2),
    "Gemma3ForConditionalGeneration(config) in zero.Init":
        (inside_zero_init(gemma3), gemma3),
    "Gemma 3 from_config": (from_config(tiny_gemma3_config()), gemma3),
    "Gemma 3 AutoModel.from_config":
        (from_config(tiny_gemma3_config(), transformers.AutoModel), gemma3_base),
}
# --8<-- [end:builds]


# --8<-- [start:verdict]
def full_weights(model):
    """name -> the full tensor, gathered if ZeRO-3 partitioned it."""
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone().double() for name, p in model.named_parameters()}


def verdict(got, want):
    """'same values' (to float32 rounding), 'same distribution' (mean and standard
    deviation within 5 standard errors of the model built without DeepSpeed: other
    draws of the same initialization), or 'NOT as intended'."""
    scale = want.abs().max().item() or 1.0
    if (got - want).abs().max().item() <= 64 * torch.finfo(torch.float32).eps * scale:
        return "same values"
    n, std = want.numel(), want.std().item()
    if n > 1 and std > 0:
        mean_error = std * math.sqrt(2 / n)  # of a difference of two means
        std_error = std / math.sqrt(2 * (n - 1))
        if (abs(got.mean().item() - want.mean().item()) <= 5 * mean_error
                and abs(got.std().item() - std) <= 5 * std_error):
            return "same distribution"
    return "NOT as intended"
# --8<-- [end:verdict]


def compare(name):
    """Each parameter's statistics, built under ZeRO-3 and without DeepSpeed."""
    under_zero3, without = MODELS[name]
    torch.manual_seed(SEED)
    try:
        got = full_weights(under_zero3())
    except Exception as error:  # a build that raises is a row of the table too
        return {"error": f"{type(error).__name__}: {error}"}
    torch.manual_seed(SEED)
    want = full_weights(without())
    assert got.keys() == want.keys(), name
    return {param: {"verdict": verdict(got[param], want[param]), "numel": want[param].numel(),
                    "std": got[param].std().item(), "plain std": want[param].std().item()}
            for param in want}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    transformers.logging.set_verbosity_error()
    results = {name: compare(name) for name in MODELS}
    if torch.distributed.get_rank() == 0:
        for name, params in results.items():
            if "error" in params:
                print(f"{name}: raised {params['error']}")
                continue
            counts = {}
            for stats in params.values():
                counts[stats["verdict"]] = counts.get(stats["verdict"], 0) + 1
            print(f"{name}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
            for param, stats in params.items():
                if stats["verdict"] == "NOT as intended":
                    print(f"  {param}: std {stats['std']:.3f}, "
                          f"without DeepSpeed {stats['plain std']:.3f}")
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
