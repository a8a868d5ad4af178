"""check_shared_reads.py on the models of these pages and on a tiny Hugging Face model.

Each function below is a factory the checker's command takes, for example
    python snippets/zero3/check_shared_reads.py snippets/zero3/check_examples.py:tied_through_a_list
Run them all (one process, CPU):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 snippets/zero3/check_examples.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the checker and the pages' models
from check_shared_reads import check_shared_reads, print_table  # noqa: E402
from language_model import VOCAB, LanguageModel, make_batch  # noqa: E402
from module_z3 import ModuleZ3, ModuleZ3WithoutRegistration  # noqa: E402
from module_z3 import make_batch as regression_batch  # noqa: E402


# --8<-- [start:factories]
def language_model():
    """The LanguageModel of "Registering external parameters": registered."""
    tokens, _ = make_batch(0)
    return LanguageModel, (tokens,)


def module_z3_without_registration():
    """ModuleZ3 with its registration left out: DeepSpeed detects this read by itself."""
    inputs, _ = regression_batch(0)
    return ModuleZ3WithoutRegistration, (inputs,)


class TiedThroughAList(nn.Module):
    """A language model that keeps its embedding weight in a list and reads it there."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, 8)
        self.mixer = nn.Linear(8, 8)
        self.tied = [self.embeddings.weight]  # a list is not a submodule

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer(self.embeddings(tokens)))
        return hidden @ self.tied[0].t()


def tied_through_a_list():
    tokens, _ = make_batch(0)
    return TiedThroughAList, (tokens,)


def loss_reads_the_weight():
    """The loss of DeepSpeed issue #1047: the training loop reads a weight itself."""

    def loop(engine, inputs):
        hidden = engine.module.mixer(engine.module.embeddings(inputs[0]))
        logits = hidden @ engine.module.embeddings.weight.t()  # outside every forward
        return F.cross_entropy(logits.reshape(-1, VOCAB), inputs[1].reshape(-1))

    return LanguageModel, make_batch(0), loop


def tiny_gpt2():
    """A Hugging Face GPT-2 with a tiny config: its head is tied to the token embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig

    from check_shared_reads import DS_CONFIG

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    zero3 = HfDeepSpeedConfig(DS_CONFIG)  # tells Transformers that ZeRO-3 partitions

    def build():
        zero3  # kept alive while the model is built: its init then gathers each weight
        return GPT2LMHeadModel(config)

    def loop(engine, inputs):
        return engine(input_ids=inputs[0], labels=inputs[0]).loss

    return build, (tokens,), loop
# --8<-- [end:factories]


FACTORIES = [language_model, module_z3_without_registration, tied_through_a_list,
             loss_reads_the_weight, tiny_gpt2]


def main():
    found = {}
    for factory in FACTORIES:
        print(f"$ check_shared_reads.py check_examples.py:{factory.__name__}")
        torch.manual_seed(0)
        found[factory.__name__] = check_shared_reads(*factory())
        print_table(found[factory.__name__])
        print()
    return {name: [vars(f) for f in findings] for name, findings in found.items()}


def check_tables():
    """The checker on every model of the automatic-detection tables, with and without
    registration: {row key: {register: findings as dicts}}."""
    import runpy

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    tables = runpy.run_path(str(Path(__file__).with_name("automatic_detection.py")))
    found = {}
    for key, (model_class, kwargs) in tables["cases"]().items():
        def loop(engine, inputs, model_class=model_class):
            logits = model_class.logits(engine, inputs[0])
            return F.cross_entropy(logits.reshape(-1, tables["VOCAB"]), inputs[1].reshape(-1))

        found[key] = {}
        for register in (False, True):
            torch.manual_seed(0)
            findings = check_shared_reads(lambda: model_class(register, **kwargs),
                                          tables["make_batch"](0), loop=loop)
            found[key][register] = [vars(f) for f in findings]
    return found


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
