"""GatheredParameters around a product in the loss function (DeepSpeed issue #1047): the backward
runs after the block has partitioned the weight again. When it trains, when it fails.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/gathered_in_loss.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEQ, BATCH, STEPS, SEED, LR = 16, 8, 5, 8, 2, 0, 0.1


class Seq2Seq(nn.Module):
    """A shared embedding table; tied=True: the output head also reads it (in this forward)."""

    def __init__(self, tied):
        super().__init__()
        self.tied = tied
        self.shared = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        self.head = None if tied else nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, inputs_embeds):
        hidden = torch.tanh(self.mixer(inputs_embeds))
        return hidden @ self.shared.weight.t() if self.tied else self.head(hidden)


# --8<-- [start:loss]
def compute_loss(engine, sampled_input, targets):
    b, l, c = sampled_input.shape
    weight = engine.module.shared.weight
    with deepspeed.zero.GatheredParameters(weight):  # full weight inside the block only
        sampled_input_embed = sampled_input.reshape(b * l, c).mm(weight)
    logits = engine(sampled_input_embed.view(b, l, DIM))
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
# --8<-- [end:loss]


# --8<-- [start:inside]
def backward_inside_the_block(engine, sampled_input, targets):
    b, l, c = sampled_input.shape
    weight = engine.module.shared.weight
    with deepspeed.zero.GatheredParameters(weight):
        sampled_input_embed = sampled_input.reshape(b * l, c).mm(weight)
        logits = engine(sampled_input_embed.view(b, l, DIM))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        engine.backward(loss)  # the weight is still whole here
    return loss
# --8<-- [end:inside]


def make_batch(step, from_generator=False):
    """Soft one-hot inputs; from_generator: they require grad, as a generator's samples do."""
    generator = torch.Generator().manual_seed(SEED + step)
    scores = torch.randn(BATCH, SEQ, VOCAB, generator=generator).requires_grad_(from_generator)
    return torch.softmax(scores, dim=-1), torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


CASES = {  # name: (tied head, inputs require grad, shared weight trainable, backward inside the block)
    "trainable weight, data inputs": (True, False, True, False),
    "trainable weight, generator inputs": (True, True, True, False),
    "weight read only in the loss, data inputs": (False, False, True, False),
    "frozen weight, data inputs": (True, False, False, False),
    "frozen weight, generator inputs": (True, True, False, False),
    "backward inside the block, generator inputs": (True, True, True, True),
}


def run(case, rank, world):
    tied, from_generator, trainable, inside = CASES[case]
    config = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Seq2Seq(tied)
    model.shared.weight.requires_grad_(trainable)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    share = BATCH // world  # each rank trains on its own slice of the batch
    mine = slice(rank * share, (rank + 1) * share)
    losses, grads = [], []
    for step in range(STEPS):
        sampled_input, targets = make_batch(step, from_generator)
        sampled_input, targets = sampled_input[mine].to(engine.device), targets[mine].to(engine.device)
        try:
            if inside:
                loss = backward_inside_the_block(engine, sampled_input, targets)
            else:
                loss = compute_loss(engine, sampled_input, targets)
                engine.backward(loss)
        except RuntimeError as error:
            if rank == 0:
                print(f"{case}: backward raised RuntimeError: {error}")
            return {"error": str(error)}
        grads.append({name: deepspeed.utils.safe_get_full_grad(p).clone()
                      for name, p in engine.module.named_parameters() if p.requires_grad})
        engine.step()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
    if rank == 0:
        print(f"{case}: shared.weight {tuple(engine.module.shared.weight.shape)} outside forward; trains, losses {[round(v, 4) for v in losses]}")
    return {"losses": losses, "grads": grads}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    seen = {case: run(case, rank, world) for case in CASES}
    torch.distributed.destroy_process_group()
    return seen


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
