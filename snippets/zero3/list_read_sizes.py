"""Does the size of a weight decide whether ZeRO-3 has it gathered? The checker's own example,
a model that reads its embedding weight through a list (a read DeepSpeed cannot see), at two
sizes, under the checker's settings (stage3_param_persistence_threshold 0) and DeepSpeed's
defaults (1e5 elements); then, for the same model with the checker's fix, what a read in the
training loop finds after each forward, backward and step.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/list_read_sizes.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from torch import nn

SEQ, BATCH, STEPS, SEED, LR = 5, 4, 3, 0, 0.1
SMALL, LARGE = (16, 8), (2048, 64)  # embedding (rows, width): 128 and 131072 elements


# --8<-- [start:model]
class ReadThroughAList(nn.Module):
    """check_shared_reads.py's example, at any size."""

    def __init__(self, vocab, width, register=False):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, width)
        self.tied = [self.embeddings.weight]  # a list is not a submodule
        if register:  # the line the checker proposes for this model
            deepspeed.zero.register_external_parameter(self, self.embeddings.weight)

    def forward(self, tokens):
        return self.embeddings(tokens) @ self.tied[0].t()
# --8<-- [end:model]


# --8<-- [start:cases]
def ds_config(world, **zero):
    """zero: ZeRO settings beside stage 3; the others are DeepSpeed's defaults."""
    return {"train_micro_batch_size_per_gpu": BATCH // world,
            "zero_optimization": {"stage": 3, **zero},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}


THRESHOLD_0 = {"stage3_param_persistence_threshold": 0}  # the checker's setting
CASES = {  # the model's size, its ZeRO settings, whether it registers the weight
    "small, threshold 0": (SMALL, THRESHOLD_0, False),
    "small, defaults": (SMALL, {}, False),
    "large, defaults": (LARGE, {}, False),
    "large, defaults, registered": (LARGE, {}, True),
}
SEEN_BY_THE_LOOP = {  # registered: it trains; the loop looks at the weight
    "small, threshold 0": (SMALL, THRESHOLD_0),
    "small, threshold 0, reuse distance 0":
        (SMALL, {**THRESHOLD_0, "stage3_max_reuse_distance": 0}),
    "small, defaults": (SMALL, {}),
    "large, defaults": (LARGE, {}),
}
# --8<-- [end:cases]


def batch(step, vocab):
    """Next-token prediction on random tokens: the same batch on every rank."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train(size, zero, register):
    """STEPS steps; each step's loss and full gradient, or the error, and the rows of the
    weight a read in the training loop finds after each forward, backward and step (0 when
    the weight is partitioned there)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = ds_config(world, **zero)
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = ReadThroughAList(*size, register=register)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    weight = engine.module.embeddings.weight
    record = {"losses": [], "grads": [], "error": None, "seen": []}
    try:
        for step in range(STEPS):
            inputs, targets = (t[rank::world].to(engine.device) for t in batch(step, size[0]))
            logits = engine(inputs)
            seen = {"forward": weight.shape[0]}
            loss = F.cross_entropy(logits.reshape(-1, size[0]), targets.reshape(-1))
            engine.backward(loss)
            seen["backward"] = weight.shape[0]
            record["grads"].append({"embeddings.weight": safe_get_full_grad(weight).cpu()})
            engine.step()
            seen["step"] = weight.shape[0]
            record["seen"].append(seen)
            torch.distributed.all_reduce(mean := loss.detach().clone())
            record["losses"].append(mean.item() / world)
    except RuntimeError as error:
        record["error"] = f"RuntimeError: {error}"
    return record


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} sequences do not split evenly over {world} ranks; run "
                         "on 2 ranks (the printed losses were checked there)")
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    results = {"cases": {}, "seen": {}}
    say("The model of check_shared_reads.py, 3 steps on 2 ranks:")
    for case, (size, zero, register) in CASES.items():
        results["cases"][case] = got = train(size, zero, register)
        losses = " ".join(f"{x:.4f}" for x in got["losses"]) or "-"
        say(f"  {case} (embedding {size[0]} x {size[1]}): losses {losses}"
            + (f", then {got['error']}" if got["error"] else ""))
    say("\nRows of the weight a read in the training loop finds (0: partitioned),")
    say("after forward / backward / step:")
    for case, (size, zero) in SEEN_BY_THE_LOOP.items():
        results["seen"][case] = got = train(size, zero, register=True)
        steps = ", ".join(f"step {n}: {s['forward']} / {s['backward']} / {s['step']}"
                          for n, s in enumerate(got["seen"]))
        say(f"  {case}: {steps}")
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
