"""Tied modules with more than a weight on 2 DeepSpeed pipeline stages: which parameters
TiedLayerSpec keeps equal (those tied_weight_attr lists), and two tie keys in one model.

Run on CPU (2 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/deepspeed_tied_norm.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

VOCAB, DIM, SEQ, SEED, LR = 16, 8, 6, 1234, 0.5
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 4


# --8<-- [start:model]
class EmbeddingWithNorm(nn.Module):
    """The tied module: an embedding and a LayerNorm, both used on both stages."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens):  # stage 0: the input layer
        return self.norm(self.embed(tokens))


def head(module, hidden):  # stage 1: the same norm, then the embedding matrix
    return module.norm(hidden) @ module.embed.weight.t()


def mix(linear, hidden):  # a second tie: one Linear (weight, bias) on both stages
    return torch.tanh(linear(hidden))


def layers(embed_attrs, mixer_attrs):
    return [TiedLayerSpec("embed", EmbeddingWithNorm, tied_weight_attr=embed_attrs),
            TiedLayerSpec("mixer", nn.Linear, DIM, DIM, forward_fn=mix,
                          tied_weight_attr=mixer_attrs),
            TiedLayerSpec("mixer", nn.Linear, DIM, DIM, forward_fn=mix,
                          tied_weight_attr=mixer_attrs),
            TiedLayerSpec("embed", EmbeddingWithNorm, forward_fn=head,
                          tied_weight_attr=embed_attrs)]


# Only what tied_weight_attr names is broadcast at the start and all-reduced every step.
WEIGHTS_ONLY = {"embed_attrs": "embed.weight", "mixer_attrs": "weight"}
# The fix: name every parameter of each tied module.
EVERY_PARAMETER = {
    "embed_attrs": [name for name, _ in EmbeddingWithNorm().named_parameters()],
    "mixer_attrs": [name for name, _ in nn.Linear(DIM, DIM).named_parameters()],
}
# --8<-- [end:model]


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def micro_batches():
    generator = torch.Generator().manual_seed(0)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def tied_parameters(module):
    """Every parameter of every tied module on this stage, named 'key.attribute'."""
    return {f"{key}.{name}": p for key, tied in sorted(module.tied_modules.items())
            for name, p in tied.named_parameters()}


def differences_between_stages(parameters):
    """Per tied parameter: the largest |stage 0 copy - stage 1 copy|."""
    result = {}
    for name, p in parameters.items():
        copies = [torch.empty_like(p) for _ in range(2)]
        torch.distributed.all_gather(copies, p.detach().contiguous())
        result[name] = (copies[0] - copies[1]).abs().max().item()
    return result


def print_table(label, synced, losses, differences):
    names = list(differences[0])  # "key.attribute" of every tied parameter
    print(f"{label}: tied_weight_attr {synced}")
    print("  max |stage 0 copy - stage 1 copy| of each parameter of the tied modules:")
    print(f"  {'':<7}{'loss':>6}" + "".join(f"{n:>{len(n) + 2}}" for n in names))
    for step, diffs in enumerate(differences):
        when = "built" if step == 0 else f"step {step - 1}"
        loss = "" if step == 0 else f"{losses[step - 1]:.4f}"
        print(f"  {when:<7}{loss:>6}"
              + "".join(f"{diffs[name]:>{len(name) + 2}.4f}" for name in names))


def train(attrs):
    ds_config = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
                 "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": 0.0}
    model = PipelineModule(layers(**attrs), num_stages=2, loss_fn=cross_entropy,
                           seed_layers=True, base_seed=SEED, partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=ds_config)
    parameters = tied_parameters(engine.module)
    differences = [differences_between_stages(parameters)]  # when built
    losses = []
    for step in range(STEPS):
        losses.append(engine.train_batch(data_iter=micro_batches()).item())
        differences.append(differences_between_stages(parameters))
    return engine, losses, differences


def main():
    # --8<-- [start:main]
    backend = get_accelerator().communication_backend_name()  # gloo on the CPU
    deepspeed.init_distributed(dist_backend=backend)
    results = {}
    for label, attrs in (("weights only", WEIGHTS_ONLY),
                         ("every parameter", EVERY_PARAMETER)):
        engine, losses, differences = train(attrs)
        comms = engine.module.tied_comms
        results[label] = {
            "losses": losses, "differences": differences,
            "synced": {key: list(comm["weight_attr"]) for key, comm in comms.items()},
            "tie_ranks": {key: comm["ranks"] for key, comm in comms.items()},
            "parameters": {n: p.detach().clone()
                           for n, p in tied_parameters(engine.module).items()}}
        if torch.distributed.get_rank() == 0:
            print_table(label, results[label]["synced"], losses, differences)
    torch.distributed.destroy_process_group()
    # --8<-- [end:main]
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
