"""DeepSpeed issue #1047 done right: the soft one-hot product moves into the forward of a wrapper module,
which registers the shared weight. Trained under ZeRO-3, it equals plain PyTorch.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/soft_inputs_wrapper.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEQ, BATCH, STEPS, SEED, LR = 16, 8, 5, 8, 3, 0, 0.1


class Seq2Seq(nn.Module):
    """Stands in for a model with a shared embedding table that accepts inputs_embeds."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        deepspeed.zero.register_external_parameter(self, self.shared.weight)

    def forward(self, inputs_embeds):
        hidden = torch.tanh(self.mixer(inputs_embeds))
        return hidden @ self.shared.weight.t()


# --8<-- [start:wrapper]
class SoftInputs(nn.Module):
    """Runs the soft one-hot product inside a forward, where ZeRO-3 gathers the weight."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # SoftInputs.forward reads model.shared.weight, so SoftInputs registers it.
        deepspeed.zero.register_external_parameter(self, model.shared.weight)

    def forward(self, sampled_input):
        b, l, c = sampled_input.shape
        sampled_input_embed = sampled_input.view(b * l, c).mm(self.model.shared.weight)
        return self.model(sampled_input_embed.view(b, l, -1))
# --8<-- [end:wrapper]


def make_batch(step):
    """Soft one-hot inputs (each row sums to 1) and targets: the same for every run."""
    generator = torch.Generator().manual_seed(SEED + step)
    sampled_input = torch.softmax(torch.randn(BATCH, SEQ, VOCAB, generator=generator), dim=-1)
    return sampled_input, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    ds_config = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    # --8<-- [start:train]
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Seq2Seq()
    wrapped = SoftInputs(model)  # no parameters of its own
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=wrapped, optimizer=optimizer, config=ds_config)

    losses, grads = [], []
    for step in range(STEPS):
        sampled_input, targets = (t.to(engine.device) for t in make_batch(step))
        share = BATCH // world  # each rank trains on its own slice of the batch
        mine = slice(rank * share, (rank + 1) * share)
        logits = engine(sampled_input[mine])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[mine].reshape(-1))
        engine.backward(loss)
        grads.append({name: deepspeed.utils.safe_get_full_grad(p).clone()
                      for name, p in engine.module.named_parameters()})
        engine.step()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
    # --8<-- [end:train]
    torch.distributed.destroy_process_group()
    return {"losses": losses, "grads": grads}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
