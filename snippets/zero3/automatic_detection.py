"""What ZeRO-3 detects by itself: one small model per access pattern, run with and without
registering the embedding weight, and what happens in each case.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/automatic_detection.py
Run and tested here on CPU only; not run on GPUs.
"""
from types import SimpleNamespace

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, BATCH, SEED, LR = 16, 8, 5, 2, 0, 0.1

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


# --8<-- [start:base]
class Pattern(nn.Module):
    """Embeddings -> mixer -> logits computed with the embedding weight.

    Each subclass reads the embedding weight in a different way. With register=True,
    the module registers the weight it reads as an external parameter.
    """

    embedding_class = nn.Embedding

    def __init__(self, register):
        super().__init__()
        self.embeddings = self.embedding_class(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        self.setup()
        if register:
            deepspeed.zero.register_external_parameter(self, self.embeddings.weight)

    def setup(self):
        pass

    def hidden(self, tokens):
        return torch.tanh(self.mixer(self.embeddings(tokens)))

    @staticmethod
    def logits(engine, tokens):
        return engine(tokens)  # the usual call: through the DeepSpeed engine
# --8<-- [end:base]


# --8<-- [start:works]
class AttributeInForward(Pattern):
    def forward(self, tokens):
        return self.hidden(tokens) @ self.embeddings.weight.t()


class EmbeddingTable(nn.Embedding):
    def forward(self, tokens=None):
        if tokens is None:
            return self.weight  # called without tokens: hands out its own parameter
        return super().forward(tokens)


class SubmoduleReturnsParameter(Pattern):
    embedding_class = EmbeddingTable

    def forward(self, tokens):
        return self.hidden(tokens) @ self.embeddings().t()


class SharedParameter(Pattern):
    def setup(self):
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embeddings.weight  # one Parameter, two owners

    def forward(self, tokens):
        return self.lm_head(self.hidden(tokens))


class EngineModuleCall(AttributeInForward):
    @staticmethod
    def logits(engine, tokens):
        return engine.module(tokens)  # the wrapped module, called directly
# --8<-- [end:works]


# --8<-- [start:fails]
class KeptInList(Pattern):
    def setup(self):
        self.tied = [self.embeddings.weight]

    def forward(self, tokens):
        return self.hidden(tokens) @ self.tied[0].t()


class KeptInDict(Pattern):
    def setup(self):
        self.tables = {"input": self.embeddings.weight}

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer(F.embedding(tokens, self.tables["input"])))
        return hidden @ self.embeddings.weight.t()


class KeptOnPlainObject(Pattern):
    def setup(self):
        self.config = SimpleNamespace(tied_weight=self.embeddings.weight)

    def forward(self, tokens):
        hidden = self.hidden(tokens)
        return hidden.reshape(-1, DIM).mm(self.config.tied_weight.t()).view(*tokens.shape, VOCAB)


class OutsideForward(Pattern):
    def forward(self, tokens):
        return self.hidden(tokens)  # the model returns hidden states only

    @staticmethod
    def logits(engine, tokens):
        hidden = engine(tokens)
        # The training loop reads the weight itself, after forward has returned.
        return hidden.matmul(engine.module.embeddings.weight.transpose(0, 1))


class ChangedInConstructor(AttributeInForward):
    def setup(self):
        self.embeddings.weight.data.mul_(0.5)  # custom init after nn.Embedding was built


class IndexedInConstructor(AttributeInForward):
    def setup(self):
        with torch.no_grad():
            self.embeddings.weight[0].zero_()  # zero the row of a padding token
# --8<-- [end:fails]


PATTERNS = {
    "attribute read in a forward": AttributeInForward,
    "submodule returns its own parameter": SubmoduleReturnsParameter,
    "shared Parameter (tied head)": SharedParameter,
    "engine.module(...) instead of engine(...)": EngineModuleCall,
    "reference kept in a list": KeptInList,
    "reference kept in a dict": KeptInDict,
    "reference kept on a non-module object": KeptOnPlainObject,
    "read outside any forward": OutsideForward,
    "changed in a constructor under zero.Init": ChangedInConstructor,
    "indexed in a constructor under zero.Init": IndexedInConstructor,
}


def make_batch():
    """The same batch on every rank, so the gradient equals the one-process gradient."""
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:try]
def try_pattern(pattern, register):
    """Build, run one forward and backward; return the loss and full gradients, or the error."""
    torch.manual_seed(SEED)
    try:
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
            model = pattern(register)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
        tokens, targets = make_batch()
        logits = pattern.logits(engine, tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        engine.backward(loss)
    except Exception as error:  # noqa: BLE001 - the error is the result we report
        return {"error": f"{type(error).__name__}: {error}"}
    grads = {name: deepspeed.utils.safe_get_full_grad(p).clone()
             for name, p in engine.module.named_parameters()}
    return {"loss": loss.item(), "grads": grads}
# --8<-- [end:try]


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name, pattern in PATTERNS.items():
        results[name] = {register: try_pattern(pattern, register) for register in (False, True)}
        if torch.distributed.get_rank() == 0:
            print(name)
            for register, label in ((False, "without registration"), (True, "with registration")):
                got = results[name][register]
                print(f"  {label:21} {got['error'] if 'error' in got else 'loss %.4f' % got['loss']}")
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
