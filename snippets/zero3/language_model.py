"""A tiny language model whose logits reuse the embedding weight, trained under ZeRO-3.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/language_model.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEQ, BATCH, STEPS, SEED, LR = 16, 8, 6, 8, 3, 0, 0.1


# --8<-- [start:model]
def compute_logits(hidden, weight):
    # A plain function: it receives a tensor and cannot know who owns it.
    return hidden @ weight.t()


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        # embeddings.weight belongs to self.embeddings, but LanguageModel.forward
        # reads it below, so LanguageModel registers it.
        deepspeed.zero.register_external_parameter(self, self.embeddings.weight)

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer(self.embeddings(tokens)))
        return compute_logits(hidden, self.embeddings.weight)
# --8<-- [end:model]


def make_batch(step):
    """Next-token prediction on random tokens: the same batch on every rank, for every run."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def main():
    # --8<-- [start:train]
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    ds_config = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        # Partition even these tiny weights in every step, as large ones are. Leave
        # it out in a real run: by default, weights of up to 1e5 elements stay whole
        # from the end of the first step (the settings run on "What DeepSpeed detects
        # automatically").
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # no clipping: the run must equal plain PyTorch
    }
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LanguageModel()  # parameters are partitioned as they are created
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    losses, grads = [], []
    for step in range(STEPS):
        mine = slice(rank, None, world)  # each rank trains on its share of the batch
        inputs, targets = (t[mine].to(engine.device) for t in make_batch(step))
        logits = engine(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        engine.backward(loss)
        # Full (unpartitioned) gradients, gathered from all ranks, before the update.
        grads.append({name: deepspeed.utils.safe_get_full_grad(p).cpu()
                      for name, p in engine.module.named_parameters()})
        engine.step()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
    torch.distributed.destroy_process_group()  # leave cleanly before the process exits
    # --8<-- [end:train]
    return {"losses": losses, "grads": grads}


# --8<-- [start:ending]
if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
# --8<-- [end:ending]
