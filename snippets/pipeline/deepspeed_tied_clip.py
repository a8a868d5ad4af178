"""Gradient clipping with a tied weight on 2 DeepSpeed pipeline stages: which norm is clipped?

Run on CPU (2 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/deepspeed_tied_clip.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.utils import clip_grad_norm_
from torch import nn

VOCAB, DIM, SEQ, SEED, LR, CLIP = 16, 8, 6, 1234, 0.5, 0.1
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 3


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, hidden):
        return torch.tanh(self.linear(hidden))


def logits_from_embedding(embedding, hidden):
    return hidden @ embedding.weight.t()


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def micro_batches(device):
    generator = torch.Generator().manual_seed(0)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator).to(device)
        yield tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:norms]
def squares(parameters):
    return sum((p.grad.detach().float() ** 2).sum() for p in parameters if p.grad is not None)


def whole_model_norm(engine):
    """The norm clip_grad_norm_ would see in one process: every gradient of every stage, the
    tied weight counted once (only the first stage's copy)."""
    tied = engine.module.tied_modules["embed"].weight
    local = squares(p for p in engine.module.parameters()
                    if engine.stage_id == 0 or p is not tied)
    total = torch.as_tensor(local, dtype=torch.float32, device=engine.device)
    dist.all_reduce(total)  # one replica: the pipeline group is every rank
    return total.sqrt().item()


def record_norms(engine):
    """Replace engine.clip_fp32_gradients by the same call (deepspeed/runtime/engine.py), plus
    a record of the norm it clips with and of the whole model's norm, before clipping."""
    norms = []

    def clip_fp32_gradients():
        whole = whole_model_norm(engine)
        stage0 = torch.as_tensor(
            squares(engine.module.parameters()) if engine.stage_id == 0 else 0.0)
        dist.broadcast(stage0, src=0)
        used = clip_grad_norm_(parameters=engine.module.parameters(),
                               max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        norms.append({"deepspeed": used.item(), "whole model": whole,
                      "stage 0 only": stage0.sqrt().item()})

    engine.clip_fp32_gradients = clip_fp32_gradients
    return norms
# --8<-- [end:norms]


def main():
    # --8<-- [start:main]
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = dist.get_world_size()
    if world != 2:  # the norms add up every rank: one replica of the 2 stages
        raise ValueError(f"the norms would count each stage once per replica on "
                         f"{world} ranks; run on 2 ranks, one per stage (the printed "
                         "norms were checked there)")
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), LayerSpec(Mixer), LayerSpec(Mixer),
              TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=logits_from_embedding)]
    model = PipelineModule(layers, num_stages=2, loss_fn=cross_entropy,
                           seed_layers=True, base_seed=SEED, partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ds_config = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
                 "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": CLIP}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    norms = record_norms(engine)
    losses = []
    for step in range(STEPS):
        losses.append(engine.train_batch(data_iter=micro_batches(engine.device)).item())
        if dist.get_rank() == 0:
            print(f"step {step}: loss {losses[-1]:.4f}, norms before clipping: "
                  + ", ".join(f"{name} {value:.4f}" for name, value in norms[-1].items()))
    # --8<-- [end:main]
    result = {"losses": losses, "norms": norms, "stage": engine.stage_id,
              "parameters": {name: p.detach().clone() for name, p in engine.module.named_parameters()}}
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
