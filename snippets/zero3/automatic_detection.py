"""What ZeRO-3 detects by itself: one small model per way of reading the embedding weight,
trained for two steps with and without registering it, each compared with plain PyTorch.
It prints the tables of the page "What DeepSpeed detects automatically" (Markdown).

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/automatic_detection.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys
from types import SimpleNamespace

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEQ, BATCH, STEPS, SEED, LR = 16, 8, 5, 2, 2, 0, 0.1

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "zero_optimization": {
        "stage": 3,
        # Partition even these tiny weights, as large ones are (the option is
        # described in DeepSpeed's configuration docs).
        "stage3_param_persistence_threshold": 0,
    },
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 0.0,
}


# --8<-- [start:reads]
# How the forward gets the embedding weight (m is the model).
READS = {
    "`self.embeddings.weight`": lambda m: m.embeddings.weight,
    '`getattr(self.embeddings, "weight")`': lambda m: getattr(m.embeddings, "weight"),
    '`dict(self.embeddings.named_parameters())["weight"]`':
        lambda m: dict(m.embeddings.named_parameters())["weight"],
    "`next(self.embeddings.parameters())`": lambda m: next(m.embeddings.parameters()),
    '`self.embeddings.state_dict(keep_vars=True)["weight"]`':
        lambda m: m.embeddings.state_dict(keep_vars=True)["weight"],
    "a list holding the module: `self.owners[0].weight`": lambda m: m.owners[0].weight,
    "a list holding the Parameter: `self.tied[0]`": lambda m: m.tied[0],
    'a dict holding the Parameter: `self.tables["tied"]`': lambda m: m.tables["tied"],
    "a non-module object holding the Parameter: `self.config.tied_weight`":
        lambda m: m.config.tied_weight,
}
# What the forward computes with it.
USES = {
    "`hidden @ weight.t()`": lambda m, hidden, tokens, weight: hidden @ weight.t(),
    "`self.out(hidden + F.embedding(tokens, weight))`":
        lambda m, hidden, tokens, weight: m.out(hidden + F.embedding(tokens, weight)),
}
# --8<-- [end:reads]

FIRST_READ, FIRST_USE = next(iter(READS)), next(iter(USES))


# --8<-- [start:model]
class Head(nn.Module):
    """Another submodule: no parameters of its own; reads the weight in its forward."""

    def forward(self, model, hidden, tokens):
        return model.use(hidden, tokens, model.read())


class Probe(nn.Module):
    embedding_class = nn.Embedding

    def __init__(self, register, read=FIRST_READ, when="after", use=FIRST_USE):
        super().__init__()
        self.read_name, self.when, self.use_name = read, when, use
        self.embeddings = self.embedding_class(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        if use != FIRST_USE:
            self.out = nn.Linear(DIM, VOCAB)
        self.head = Head()
        # References kept outside the module tree (lists, dicts and plain objects
        # are not submodules); READS picks one of them or none.
        self.owners = [self.embeddings]
        self.tied = [self.embeddings.weight]
        self.tables = {"tied": self.embeddings.weight}
        self.config = SimpleNamespace(tied_weight=self.embeddings.weight)
        self.setup()
        if register:  # registered on the module whose forward reads the weight
            reader = self.head if when == "head" else self
            deepspeed.zero.register_external_parameter(reader, self.embeddings.weight)

    def setup(self):
        pass

    def read(self):
        return READS[self.read_name](self)

    def use(self, hidden, tokens, weight):
        return USES[self.use_name](self, hidden, tokens, weight)

    def hidden(self, tokens):
        return torch.tanh(self.mixer(self.embeddings(tokens)))  # embeddings' own forward

    def forward(self, tokens):
        if self.when == "before":
            weight = self.read()  # before self.embeddings(tokens) has run in this step
            return self.use(self.hidden(tokens), tokens, weight)
        if self.when == "after":
            hidden = self.hidden(tokens)
            return self.use(hidden, tokens, self.read())  # after it
        return self.head(self, self.hidden(tokens), tokens)  # in head.forward

    @staticmethod
    def logits(engine, tokens):
        return engine(tokens)  # the usual call: through the DeepSpeed engine
# --8<-- [end:model]


# --8<-- [start:others]
class EmbeddingTable(nn.Embedding):
    def forward(self, tokens=None):
        if tokens is None:
            return self.weight  # called without tokens: hands out its own parameter
        return super().forward(tokens)


class SubmoduleReturnsParameter(Probe):
    embedding_class = EmbeddingTable

    def forward(self, tokens):
        return self.hidden(tokens) @ self.embeddings().t()


class SharedParameter(Probe):
    def setup(self):
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embeddings.weight  # one Parameter, two owners

    def forward(self, tokens):
        return self.lm_head(self.hidden(tokens))


class EngineModuleCall(Probe):
    @staticmethod
    def logits(engine, tokens):
        return engine.module(tokens)  # the wrapped module, called directly


class OutsideForward(Probe):
    def forward(self, tokens):
        return self.hidden(tokens)  # the model returns hidden states only

    @staticmethod
    def logits(engine, tokens):
        hidden = engine(tokens)
        # The training loop reads the weight itself, after forward has returned.
        return hidden.matmul(engine.module.embeddings.weight.transpose(0, 1))


class ChangedInConstructor(Probe):
    def setup(self):
        self.embeddings.weight.data.mul_(0.5)  # custom init after nn.Embedding was built


class IndexedInConstructor(Probe):
    def setup(self):
        with torch.no_grad():
            self.embeddings.weight[0].zero_()  # zero the row of a padding token
# --8<-- [end:others]


WHEN = {
    "before": "read before `self.embeddings(tokens)`",
    "after": "read after it",
    "head": "read in `head.forward`, after it",
}
OTHERS = {  # stable row names: other pages refer to them
    "a submodule returns its own parameter: `self.embeddings()`": SubmoduleReturnsParameter,
    "a shared Parameter: `lm_head.weight = embeddings.weight`": SharedParameter,
    "`engine.module(tokens)` instead of `engine(tokens)`": EngineModuleCall,
    "read outside any forward, in the training loop": OutsideForward,
    "changed in a constructor, after `zero.Init` partitioned it": ChangedInConstructor,
    "indexed in a constructor, after `zero.Init` partitioned it": IndexedInConstructor,
}


SECOND_TABLE_READS = (FIRST_READ, "a list holding the Parameter: `self.tied[0]`")


def cases():
    """{key: (model class, keyword arguments)} for every model the tables show."""
    found = {}
    for use in USES:
        for read in READS if use == FIRST_USE else SECOND_TABLE_READS:
            for when in WHEN:
                found[read, when, use] = (Probe, {"read": read, "when": when, "use": use})
    for row, model_class in OTHERS.items():
        found[row,] = (model_class, {})
    return found


def make_batch(step):
    """The same batch on every rank, so the gradient equals the one-process gradient."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:try]
def train(model_class, kwargs, register):
    """Build under zero.Init, train STEPS steps; losses and full gradients, or the error."""
    torch.manual_seed(SEED)
    losses, grads, where = [], [], "while building the model"
    try:
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
            model = model_class(register, **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
        for step in range(STEPS):
            where = f"in step {step}"
            tokens, targets = (t.to(engine.device) for t in make_batch(step))
            logits = model_class.logits(engine, tokens)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            engine.backward(loss)
            grads.append({name: deepspeed.utils.safe_get_full_grad(p).cpu()
                          for name, p in engine.module.named_parameters()})
            engine.step()
            losses.append(loss.item())
    except Exception as error:  # noqa: BLE001 - the error is the result we report
        return {"where": where, "error": f"{type(error).__name__}: {error}"}
    return {"losses": losses, "grads": grads}
# --8<-- [end:try]


class PlainEngine:
    """engine(tokens) and engine.module for the run without DeepSpeed."""

    def __init__(self, module):
        self.module = module

    def __call__(self, tokens):
        return self.module(tokens)


def train_plain(model_class, kwargs):
    """The same model, seed and batches in this process, without DeepSpeed."""
    torch.manual_seed(SEED)
    model = model_class(False, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        tokens, targets = make_batch(step)
        logits = model_class.logits(PlainEngine(model), tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


# Equal means equal up to float32 rounding: a distributed run sums in another order, so
# allow 64 float32 epsilons of the largest value compared (a relative 7.6e-6).
ULPS = 64


def close(got, want):
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    limit = ULPS * torch.finfo(torch.float32).eps * want.abs().max()
    return got.shape == want.shape and bool((got - want).abs().max() <= limit)


def verdict(got, plain, errors):
    """works / silently wrong / fails, compared with plain PyTorch in every step."""
    if "error" in got:
        return f"**fails** {got['where']} ({errors[got['error']]})"
    same = close(got["losses"], plain["losses"]) and all(
        g.keys() == p.keys() and all(close(g[n], p[n]) for n in p)
        for g, p in zip(got["grads"], plain["grads"]))
    return "works" if same else "**silently wrong**"


def print_tables(results):
    """The page's tables, in Markdown, from this run's results."""
    messages = sorted({got["error"] for result in results.values()
                       for got in (result[False], result[True]) if "error" in got})
    errors = {message: "abcdefghij"[i] for i, message in enumerate(messages)}

    def cell(key, register):
        return verdict(results[key][register], results[key]["plain"], errors)

    def registered(keys):  # one verdict for the row's three cells when they agree
        return " / ".join(dict.fromkeys(cell(key, True) for key in keys))

    print(f"*works*: in each of the {STEPS} steps, the loss and every full gradient equal plain "
          f"PyTorch's within {ULPS} float32 epsilons of the largest value compared; "
          "*silently wrong*: no error, but the results differ; *fails*: the run raised the error "
          "listed under the tables.")
    print()
    print("Where the forward gets the weight, and when it reads it:")
    print()
    print("| How the forward gets the weight | " + " | ".join(WHEN.values()) + " | with registration |")
    print("| --- " * (len(WHEN) + 2) + "|")
    for read in READS:
        keys = [(read, when, FIRST_USE) for when in WHEN]
        print(f"| {read} | " + " | ".join(cell(key, False) for key in keys) + f" | {registered(keys)} |")
    print()
    print("Whether the backward needs the weight's values (a product with `weight.t()`: yes; "
          "a lookup with `F.embedding`: no):")
    print()
    print("| Gets the weight with | Computes | " + " | ".join(WHEN.values()) + " | with registration |")
    print("| --- " * (len(WHEN) + 3) + "|")
    for read in SECOND_TABLE_READS:
        for use in USES:
            keys = [(read, when, use) for when in WHEN]
            print(f"| {read} | {use} | " + " | ".join(cell(key, False) for key in keys)
                  + f" | {registered(keys)} |")
    print()
    print("Other ways a model shares or touches the weight:")
    print()
    print("| Pattern | without registration | with registration |")
    print("| --- | --- | --- |")
    for row in OTHERS:
        print(f"| {row} | {cell((row,), False)} | {cell((row,), True)} |")
    print()
    print("The errors in the failing cells:")
    print()
    for message, letter in errors.items():
        print(f"- ({letter}) `{message}`")


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    results = {}
    for key, (model_class, kwargs) in cases().items():
        results[key] = {
            "plain": train_plain(model_class, kwargs),
            **{register: train(model_class, kwargs, register) for register in (False, True)},
        }
    if torch.distributed.get_rank() == 0:
        print_tables(results)
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
