"""A submodule hands out its own weight in its output: in a tuple, in a dict, or nested
deeper (a dict inside a tuple). The parent multiplies by it. Each form is trained for three
steps under ZeRO-3 and printed beside the same model trained without DeepSpeed.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/returned_parameter.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEQ, BATCH, STEPS, SEED, LR = 16, 8, 5, 2, 3, 0, 0.1

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    # Partition even these tiny weights, as large ones are.
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 0.0,
}


# --8<-- [start:model]
# How the embedding's forward returns its weight, and how the model takes it back out.
FORMS = {
    "tuple": (lambda hidden, weight: (hidden, weight),
              lambda out: (out[0], out[1])),
    "dict": (lambda hidden, weight: {"hidden": hidden, "weight": weight},
             lambda out: (out["hidden"], out["weight"])),
    "dict inside a tuple": (lambda hidden, weight: (hidden, {"weight": weight}),
                            lambda out: (out[0], out[1]["weight"])),
}


class EmbeddingWithWeight(nn.Embedding):
    def __init__(self, form):
        super().__init__(VOCAB, DIM)
        self.pack = FORMS[form][0]

    def forward(self, tokens):
        return self.pack(super().forward(tokens), self.weight)  # hands out its weight


class LanguageModel(nn.Module):
    def __init__(self, form, register=False):
        super().__init__()
        self.unpack = FORMS[form][1]
        self.embeddings = EmbeddingWithWeight(form)
        self.mixer = nn.Linear(DIM, DIM)
        if register:  # the fix when DeepSpeed does not see the returned weight
            deepspeed.zero.register_external_parameter(self, self.embeddings.weight)

    def forward(self, tokens):
        hidden, weight = self.unpack(self.embeddings(tokens))
        return torch.tanh(self.mixer(hidden)) @ weight.t()  # after embeddings.forward
# --8<-- [end:model]


CASES = {  # name printed: (form, register)
    "tuple": ("tuple", False),
    "dict": ("dict", False),
    "dict inside a tuple": ("dict inside a tuple", False),
    "dict inside a tuple, registered": ("dict inside a tuple", True),
}


def make_batch(step):
    """The same batch on every rank, so the gradient equals the one-process gradient."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def train(form, register):
    """STEPS steps under ZeRO-3: the losses and full gradients, or where it failed and why."""
    torch.manual_seed(SEED)
    losses, grads = [], []
    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        model = LanguageModel(form, register)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    for step in range(STEPS):
        tokens, targets = (t.to(engine.device) for t in make_batch(step))
        try:
            loss = loss_of(engine(tokens), targets)
        except RuntimeError as error:  # the failure is the result reported for this form
            return {"step": step, "error": f"{type(error).__name__}: {error}"}
        engine.backward(loss)
        grads.append({name: deepspeed.utils.safe_get_full_grad(p).clone()
                      for name, p in engine.module.named_parameters()})
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def train_plain():
    """The same model, seed and batches in one process, without DeepSpeed (every form
    computes the same)."""
    torch.manual_seed(SEED)
    model = LanguageModel("tuple")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tokens, targets = make_batch(step)
        loss = loss_of(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    results = {name: train(*case) for name, case in CASES.items()}
    if torch.distributed.get_rank() == 0:
        plain = ", ".join(f"{loss:.4f}" for loss in train_plain())
        print(f"{'without DeepSpeed':>32}: losses {plain}")
        for name, got in results.items():
            if "error" in got:
                print(f"{name:>32}: fails in step {got['step']}: {got['error']}")
            else:
                print(f"{name:>32}: losses {', '.join(f'{x:.4f}' for x in got['losses'])}")
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
