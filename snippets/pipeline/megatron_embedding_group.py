"""Megatron Core's embedding group: the tie between the first and the last stage.

Run on CPU (2 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/megatron_embedding_group.py
(DS_ACCELERATOR is not used here; the command is the one of the DeepSpeed examples.)
Run and tested here on CPU only, over gloo, with megatron-core 0.16.1; not run on GPUs.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
# A private function (leading underscore): the step of finalize_model_grads that keeps
# the tie. It is not a public API and may change between releases.
from megatron.core.distributed.finalize_model_grads import (
    _allreduce_word_embedding_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from torch import nn

VOCAB, DIM, SEQ, SEED, LR = 16, 8, 6, 0, 0.5
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 3


class TiedLanguageModel(nn.Module):
    """The model in one process: one weight for the embedding and the output head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer1 = nn.Linear(DIM, DIM)
        self.mixer2 = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):  # pragma: no cover (the test's one-process reference)
        hidden = torch.tanh(self.mixer1(self.embed(tokens)))
        hidden = torch.tanh(self.mixer2(hidden))
        return self.head(hidden)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch():
    """MICRO_BATCHES * MICRO_BATCH sequences: the same on every rank, step and run."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH, SEQ + 1),
                           generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def tiny_gpt_config():
    return TransformerConfig(num_layers=2, hidden_size=DIM, num_attention_heads=2,
                             pipeline_model_parallel_size=2,
                             pipeline_dtype=torch.float32,
                             use_cpu_initialization=True)


# --8<-- [start:startup]
def build_tied_gpt(config):
    """Megatron's own start-up tie: GPTModel calls setup_embeddings_and_output_layer."""
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=True)
# --8<-- [end:startup]


# --8<-- [start:stage]
class Stage(nn.Module):
    """One pipeline stage of TiedLanguageModel: embed + mixer1, or mixer2 + head. It has
    what finalize_model_grads reads from a Megatron model chunk (pre_process, the flag,
    shared_embedding_or_output_weight(); ddp_config, set by Megatron's DDP wrapper)."""

    def __init__(self, full, first):
        super().__init__()
        self.pre_process, self.post_process = first, not first
        self.share_embeddings_and_output_weights = True
        self.ddp_config = DistributedDataParallelConfig()
        if first:
            self.embed, self.mixer1 = full.embed, full.mixer1
        else:
            self.mixer2 = full.mixer2
            self.head = nn.Linear(DIM, VOCAB, bias=False)  # its own copy, own values

    def shared_embedding_or_output_weight(self):
        return self.embed.weight if self.pre_process else self.head.weight

    def forward(self, x):
        if self.pre_process:
            return torch.tanh(self.mixer1(self.embed(x)))
        return self.head(torch.tanh(self.mixer2(x)))
# --8<-- [end:stage]


def main():
    # --8<-- [start:group]
    dist.init_process_group()  # no backend named: gloo for CPU tensors
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=2)
    embedding_group = parallel_state.get_embedding_group()
    group_ranks = dist.get_process_group_ranks(embedding_group)
    # --8<-- [end:group]
    config = tiny_gpt_config()
    try:
        build_tied_gpt(config)
    except AssertionError as error:  # by the source: weight.data.cuda()
        startup_error = f"{type(error).__name__}: {error}"
    else:  # pragma: no cover (with CUDA, not run here)
        startup_error = None

    # --8<-- [start:train]
    torch.manual_seed(SEED)
    first = parallel_state.is_pipeline_first_stage()
    stage = Stage(TiedLanguageModel(), first)
    shared = stage.shared_embedding_or_output_weight()
    before = shared.detach().clone()
    # Megatron's start-up tie, the same two lines without its .cuda(): the last stage's
    # copy becomes zeros, and the sum over the group is then the first stage's values.
    if not first:
        shared.data.fill_(0)
    dist.all_reduce(shared.data, group=embedding_group)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    tokens, targets = batch()
    losses, shares, summed = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        step_loss = torch.zeros(())
        micro_batches = zip(tokens.tensor_split(MICRO_BATCHES),
                            targets.tensor_split(MICRO_BATCHES))
        for x, y in micro_batches:
            if first:  # forward, send the activations on, backward from their gradient
                hidden = stage(x)
                dist.send(hidden.detach(), dst=1)
                grad = torch.empty_like(hidden)
                dist.recv(grad, src=1)
                hidden.backward(grad)
            else:
                hidden = torch.empty(MICRO_BATCH, SEQ, DIM)
                dist.recv(hidden, src=0)
                hidden.requires_grad_()
                loss = cross_entropy(stage(hidden), y)
                (loss / MICRO_BATCHES).backward()
                dist.send(hidden.grad, dst=0)
                step_loss += loss.detach() / MICRO_BATCHES
        shares.append(shared.grad.clone())  # this stage's use only
        # What finalize_model_grads does for the tie: all-reduce (sum) the gradient of
        # the shared weight over the embedding group, on the first and the last stage.
        _allreduce_word_embedding_grads([stage], config)
        summed.append(shared.grad.clone())
        optimizer.step()
        dist.broadcast(step_loss, src=1)  # the last stage has the loss
        losses.append(step_loss.item())
    # --8<-- [end:train]
    copies = [torch.empty_like(shared) for _ in range(2)]
    dist.all_gather(copies, shared.detach().contiguous())
    starts = [torch.empty_like(shared) for _ in range(2)]
    dist.all_gather(starts, before)
    first_shares = [torch.empty_like(shared) for _ in range(2)]
    dist.all_gather(first_shares, shares[0])
    if rank == 0:
        print(f"embedding group ranks: {group_ranks}")
        print("GPTModel(share_embeddings_and_output_weights=True) on CPU: "
              f"{startup_error}")
        print("before the start-up tie, max |first copy - last copy|: "
              f"{(starts[0] - starts[1]).abs().max().item():.4f}")
        for step, loss in enumerate(losses):
            print(f"step {step}: loss {loss:.4f}")
        norms = ", ".join(f"stage {s} {g.norm().item():.4f}"
                          for s, g in enumerate(first_shares))
        print(f"step 0, norm of each stage's share of the tied gradient: {norms}; "
              f"after _allreduce_word_embedding_grads {summed[0].norm().item():.4f}")
        print(f"max |first copy - last copy| after {STEPS} steps: "
              f"{(copies[0] - copies[1]).abs().max().item():.4f}")
    dist.destroy_process_group()
    return {"group_ranks": group_ranks, "startup_error": startup_error,
            "starts": starts, "losses": losses, "first_shares": first_shares,
            "first_summed": summed[0], "copies": copies,
            "weight": shared.detach().clone()}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
