"""from_pretrained under ZeRO-3 (HfDeepSpeedConfig alive, so inside zero.Init): does every
weight of the checkpoint arrive? A tiny Mixtral, whose experts the model packs into 3D
parameters while its checkpoint keeps one matrix per expert, and a custom model with raw
nn.Parameter weights (a 1-D scale, a 3-D packed tensor). Each loaded weight, gathered, is
compared with the same checkpoint loaded in one process without DeepSpeed.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/load_report.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here). Nothing is downloaded.
"""
import os
import sys
import tempfile

import deepspeed
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from safetensors.torch import load_file
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.integrations import HfDeepSpeedConfig

SEED = 0
CONFIG = {"train_micro_batch_size_per_gpu": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class ScaledConfig(PretrainedConfig):
    model_type = "scaled-experts-example"

    def __init__(self, vocab=16, hidden=8, experts=2, **kwargs):
        self.vocab, self.hidden, self.experts = vocab, hidden, experts
        super().__init__(**kwargs)


# --8<-- [start:custom]
class ScaledExperts(PreTrainedModel):
    """Raw nn.Parameter weights, as custom layers hold them."""
    config_class = ScaledConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.scale = nn.Parameter(torch.ones(config.hidden))
        self.experts = nn.Parameter(
            torch.empty(config.experts, config.hidden, config.hidden))
        self.post_init()

    def _init_weights(self, module):
        if module is self:
            nn.init.normal_(self.experts, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
# --8<-- [end:custom]


def mixtral():
    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=16)
    return MixtralForCausalLM(config)


def scaled_experts():
    model = ScaledExperts(ScaledConfig())
    with torch.no_grad():  # away from the initial values, so a load that misses them shows
        model.scale.mul_(3.0)
        model.experts.add_(1.0)
    return model


def saved(build):
    """A checkpoint written in one process, before the process group exists."""
    torch.manual_seed(SEED)
    directory = tempfile.mkdtemp(prefix="load-report-")
    build().save_pretrained(directory)
    return directory


def compare(model_class, directory):
    """Load under ZeRO-3, gather each weight, compare with the one-process load."""
    expected = dict(model_class.from_pretrained(directory).named_parameters())
    # --8<-- [start:load]
    hf_config = HfDeepSpeedConfig(CONFIG)  # what TrainingArguments(deepspeed=...) creates
    model, report = model_class.from_pretrained(directory, output_loading_info=True)
    differ = []
    for name, weight in model.named_parameters():
        with deepspeed.zero.GatheredParameters(weight):  # full on every rank, for reading
            if not torch.equal(weight, expected[name]):
                differ.append(name)  # pragma: no cover - older releases (below)
    # --8<-- [end:load]
    del hf_config
    return {"missing": sorted(report["missing_keys"]), "differ": differ,
            "weights": len(expected)}


def main():
    directories = {MixtralForCausalLM: saved(mixtral), ScaledExperts: saved(scaled_experts)}
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    say(f"transformers {transformers.__version__}")
    on_disk = sorted(load_file(os.path.join(directories[MixtralForCausalLM],
                                            "model.safetensors")))
    say("Mixtral checkpoint, expert keys:", [key for key in on_disk if "experts.0." in key])
    results = {}
    for model_class, directory in directories.items():
        got = results[model_class.__name__] = compare(model_class, directory)
        say(f"{model_class.__name__}: {len(got['missing'])} of {got['weights']} weights "
            f"reported missing, {len(got['differ'])} differ from the checkpoint")
        for name in got["differ"]:  # pragma: no cover - older releases: the note
            say(f"  differs: {name}{' (reported missing)' if name in got['missing'] else ''}")
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
