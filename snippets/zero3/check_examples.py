"""check_shared_reads.py on the models of these pages and on a tiny Hugging Face model.

Each function below is a factory the checker's command takes, for example
    python snippets/zero3/check_shared_reads.py snippets/zero3/check_examples.py:tied_through_a_list
Run them all (one process, CPU):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 1 snippets/zero3/check_examples.py
Run and tested here on CPU only; not run on GPUs.
"""
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the checker and the pages' models
from check_shared_reads import DS_CONFIG, apply_fixes, check_shared_reads, loop_fixes  # noqa: E402
from check_shared_reads import default_loop, print_table  # noqa: E402
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


class HeldOutsideTheTree(nn.Module):
    """A head kept in `self.__dict__`, not a submodule (out of `parameters()` and the
    state dict, on purpose): built inside zero.Init, ZeRO-3 partitions it, never gathers it."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, 8)
        self.__dict__["head"] = nn.Linear(8, VOCAB)  # not registered as a submodule

    def forward(self, tokens):
        return self.head(torch.tanh(self.embeddings(tokens)))


def held_outside_the_tree():
    tokens, _ = make_batch(0)
    return HeldOutsideTheTree, (tokens,)


def tiny_gpt2():
    """A Hugging Face GPT-2 with a tiny config: its head is tied to the token embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    zero3 = HfDeepSpeedConfig(DS_CONFIG)  # tells Transformers that ZeRO-3 partitions

    def build():
        zero3  # kept alive while the model is built (its init still writes partitions)
        return GPT2LMHeadModel(config)

    build.config, build.hf_config = config, HfDeepSpeedConfig  # for the fix's run

    def loop(engine, inputs):
        return engine(input_ids=inputs[0], labels=inputs[0]).loss

    return build, (tokens,), loop
# --8<-- [end:factories]


FACTORIES = [language_model, module_z3_without_registration, tied_through_a_list,
             loss_reads_the_weight, held_outside_the_tree, tiny_gpt2]


# --8<-- [start:fixed_loop]
def loss_reads_the_weight_fixed(engine, inputs, findings):
    """That loop with the checker's fix applied as it says: its block around the line
    that reads the weight, and around engine.backward(loss)."""
    hidden = engine.module.mixer(engine.module.embeddings(inputs[0]))
    with loop_fixes(findings, engine):
        logits = hidden @ engine.module.embeddings.weight.t()  # outside every forward
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), inputs[1].reshape(-1))
        engine.backward(loss)
    return loss
# --8<-- [end:fixed_loop]


class PlainEngine:
    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def train(factory, findings=None, zero3=True, start=None):
    """3 steps of the factory's model and loop, every rank on the whole batch (so the
    average of the ranks' gradients is the gradient): the initial full weights as built,
    losses and full gradients, or the error. findings: their fixes applied. start: full
    weights to train from instead (by name; the one-process run starts where ZeRO-3 did)."""
    build, inputs, *loop = factory()
    loop = loop[0] if loop else default_loop
    rebuild = [f["fix"] for f in findings or () if f["fix"].startswith("model = ")]
    torch.manual_seed(0)
    if not zero3:
        model = build()
    elif rebuild:  # the constructor fix: from_config while an HfDeepSpeedConfig is alive
        keep = build.hf_config(DS_CONFIG)  # noqa: F841 - alive while the model is built
        names = {"transformers": sys.modules["transformers"], "config": build.config}
        exec(rebuild[0], names)
        model = names["model"]
    else:
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
            model = build()
    apply_fixes(model, findings or ())
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=zero3):
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if start is not None and n in start:
                p.copy_(start[n])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if zero3:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    else:
        engine = PlainEngine(model)
    losses, grads = [], []
    try:
        for _ in range(3):
            if findings and factory is loss_reads_the_weight:
                loss = loss_reads_the_weight_fixed(engine, inputs, findings)
            elif zero3:
                loss = loop(engine, inputs)
                engine.backward(loss)
            else:
                loss = loop(engine, inputs)
                loss.backward()
            grads.append({n: full_grad(p) if zero3 else p.grad.clone()
                          for n, p in model.named_parameters() if p.requires_grad})
            if zero3:
                engine.step()
            else:
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    except Exception as error:  # noqa: BLE001 - the error is the result
        return {"initial": initial, "error": f"{type(error).__name__}: {error}"}
    return {"initial": initial, "losses": losses, "grads": grads}


def full_grad(param):
    grad = deepspeed.utils.safe_get_full_grad(param)
    return torch.zeros(param.ds_shape) if grad is None else grad.clone()


def mended():
    """On several ranks: every factory of CHECK_FIXES ({factory: findings}) trained under
    ZeRO-3 as it is and with the fixes applied; rank 0 also trains it in one process,
    and for the from_config fix builds Transformers' own initialisation with the same
    draws. {factory: {"as it is", "fixed", "plain", "plain init"}}."""
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    fixes = json.loads(os.environ["CHECK_FIXES"])
    runs = {}
    for name, findings in fixes.items():
        factory = globals()[name]
        runs[name] = {"as it is": train(factory), "fixed": train(factory, findings)}
        if torch.distributed.get_rank() == 0:
            start = runs[name]["fixed"]["initial"]
            runs[name]["plain"] = train(factory, zero3=False, start=start)
            build = factory()[0]
            if hasattr(build, "hf_config"):  # what Transformers' init gives, same draws
                runs[name]["plain init"] = transformers_init(build)
    torch.distributed.destroy_process_group()
    return runs


def transformers_init(build):
    """The model built without any init, NaN everywhere, then Transformers' init: the
    weights from_config gives under ZeRO-3 (same draws); a NaN left was never written."""
    from transformers.initialization import no_init_weights

    torch.manual_seed(0)
    with no_init_weights():
        model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


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
