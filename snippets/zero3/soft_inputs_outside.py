"""DeepSpeed issue #1047 as reported: soft one-hot inputs multiplied with the shared embedding
weight in the loss function, outside every forward. Under ZeRO-3 this fails.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/soft_inputs_outside.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEQ, BATCH, SEED, LR = 16, 8, 5, 8, 0, 0.1


class Seq2Seq(nn.Module):
    """Stands in for a model with a shared embedding table that accepts inputs_embeds."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        # What the reader of DeepSpeed issue #1047 tried: register the weight on the model.
        deepspeed.zero.register_external_parameter(self, self.shared.weight)

    def forward(self, inputs_embeds):  # never reached: compute_loss fails before calling it
        hidden = torch.tanh(self.mixer(inputs_embeds))
        return hidden @ self.shared.weight.t()


# --8<-- [start:loss]
def compute_loss(engine, sampled_input, targets):
    b, l, c = sampled_input.shape
    # Runs in the training loop, outside every forward: the weight is still partitioned.
    sampled_input_embed = sampled_input.view(b * l, c).mm(engine.module.shared.weight)
    logits = engine(sampled_input_embed.view(b, l, DIM))  # never reached: the line above raises
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))  # never reached
# --8<-- [end:loss]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    ds_config = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Seq2Seq()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    generator = torch.Generator().manual_seed(SEED)
    sampled_input = torch.softmax(torch.randn(BATCH // world, SEQ, VOCAB, generator=generator), dim=-1)
    targets = torch.randint(0, VOCAB, (BATCH // world, SEQ), generator=generator)
    sampled_input, targets = sampled_input.to(engine.device), targets.to(engine.device)
    loss = compute_loss(engine, sampled_input, targets)  # raises
    engine.backward(loss)  # never reached: compute_loss raises
    torch.distributed.destroy_process_group()  # never reached


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # never reached: main() raises (the ending of every example)
    os._exit(0)  # never reached
