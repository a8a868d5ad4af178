"""Megatron Core's embedding group on four pipeline stages: the middle stages hold no copy of the
tied weight and are in no embedding group; code that asks them for it fails.

Run on CPU (4 processes, one stage each; with 2, two stages and no middle stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 snippets/pipeline/megatron_four_stages.py
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

VOCAB, DIM, SEQ, SEED, LR, MIXERS = 16, 8, 6, 0, 0.5, 4
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 3


class TiedLanguageModel(nn.Module):
    """The model in one process: one weight for the embedding and the output head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(MIXERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):  # pragma: no cover (the test's one-process reference)
        hidden = self.embed(tokens)
        for mixer in self.mixers:
            hidden = torch.tanh(mixer(hidden))
        return self.head(hidden)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch():
    """MICRO_BATCHES * MICRO_BATCH sequences: the same on every rank, step and run."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH, SEQ + 1),
                           generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


class Stage(nn.Module):
    """Stage `index` of `stages` of TiedLanguageModel: the first has the embedding, the
    last a copy of the tied weight as its head, every stage its share of the mixers. It
    has what finalize_model_grads reads from a Megatron model chunk."""

    def __init__(self, full, index, stages):
        super().__init__()
        self.pre_process, self.post_process = index == 0, index == stages - 1
        self.share_embeddings_and_output_weights = True
        self.ddp_config = DistributedDataParallelConfig()
        share = MIXERS // stages
        self.mixers = full.mixers[index * share:(index + 1) * share]
        if self.pre_process:
            self.embed = full.embed
        if self.post_process:
            self.head = nn.Linear(DIM, VOCAB, bias=False)  # its own copy, own values

    def shared_embedding_or_output_weight(self):
        if self.pre_process:
            return self.embed.weight
        return self.head.weight if self.post_process else None  # a middle stage: none

    def forward(self, x):
        hidden = self.embed(x) if self.pre_process else x
        for mixer in self.mixers:
            hidden = torch.tanh(mixer(hidden))
        return self.head(hidden) if self.post_process else hidden


# --8<-- [start:converter]
def broadcast_shared_embedding(stage):
    """After loading a checkpoint into the first stage, give the last stage's head the
    embedding's values: every stage asks for the embedding group."""
    group = parallel_state.get_embedding_group()
    ranks = dist.get_process_group_ranks(group)
    dist.broadcast(stage.shared_embedding_or_output_weight().data, src=ranks[0],
                   group=group)


def broadcast_shared_embedding_fixed(stage):
    """The same, asked only where a copy is: the first and the last stage."""
    if not parallel_state.is_rank_in_embedding_group():
        return  # a middle stage: no copy, no embedding group
    group = parallel_state.get_embedding_group()
    ranks = dist.get_process_group_ranks(group)
    dist.broadcast(stage.shared_embedding_or_output_weight().data, src=ranks[0],
                   group=group)
# --8<-- [end:converter]


def tiny_gpt_config(stages):
    return TransformerConfig(num_layers=MIXERS, hidden_size=DIM, num_attention_heads=2,
                             pipeline_model_parallel_size=stages,
                             pipeline_dtype=torch.float32, use_cpu_initialization=True)


def gpt_model(config):
    """Megatron's GPTModel with the tie, this rank's stage of it."""
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=True)


def train(stage, config, rank, stages):
    """GPipe by hand: each micro-batch forward through the stages, then backward."""
    first, last = stage.pre_process, stage.post_process
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    tokens, targets = batch()
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        step_loss = torch.zeros(())
        for x, y in zip(tokens.tensor_split(MICRO_BATCHES),
                        targets.tensor_split(MICRO_BATCHES)):
            if not first:
                x = torch.empty(MICRO_BATCH, SEQ, DIM)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            out = stage(x)
            if last:
                loss = cross_entropy(out, y)
                (loss / MICRO_BATCHES).backward()
                step_loss += loss.detach() / MICRO_BATCHES
            else:
                dist.send(out.detach(), dst=rank + 1)
                grad = torch.empty_like(out)
                dist.recv(grad, src=rank + 1)
                out.backward(grad)
            if not first:
                dist.send(x.grad, dst=rank - 1)
        # The tie, as finalize_model_grads keeps it: a middle stage does nothing.
        _allreduce_word_embedding_grads([stage], config)
        optimizer.step()
        dist.broadcast(step_loss, src=stages - 1)  # the last stage has the loss
        losses.append(step_loss.item())
    return losses


def main():
    dist.init_process_group()  # no backend named: gloo for CPU tensors
    rank, stages = dist.get_rank(), dist.get_world_size()
    # --8<-- [start:group]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=stages)
    group = parallel_state.get_embedding_group(check_initialized=False)
    in_group = parallel_state.is_rank_in_embedding_group()
    group_ranks = dist.get_process_group_ranks(group) if group is not None else None
    # --8<-- [end:group]
    config = tiny_gpt_config(stages)
    try:
        model = gpt_model(config)
    except AssertionError as error:  # by the source: weight.data.cuda(), first and last
        built = f"{type(error).__name__}: {error}"
        holds = None
    else:
        built = "built"
        holds = {"layers": len(model.decoder.layers),
                 "embedding": hasattr(model, "embedding"),
                 "output_layer": hasattr(model, "output_layer"),
                 "shared": model.shared_embedding_or_output_weight()}
        del model

    # --8<-- [start:convert]
    torch.manual_seed(SEED)
    stage = Stage(TiedLanguageModel(), rank, stages)
    try:
        broadcast_shared_embedding(stage)
        converted = "ok"
    except AssertionError as error:
        converted = f"{type(error).__name__}: {error}"
    broadcast_shared_embedding_fixed(stage)
    # --8<-- [end:convert]
    shared = stage.shared_embedding_or_output_weight()
    start = shared.detach().clone() if shared is not None else None
    losses = train(stage, config, rank, stages)

    print(f"[rank {rank}] stage {rank}: embedding group {group_ranks}, "
          f"holds {sorted(name for name, _ in stage.named_parameters())}")
    if holds is None:
        print(f"  GPTModel with the tie: {built}")
    else:
        print(f"  GPTModel with the tie: {holds['layers']} decoder layer(s), "
              f"embedding {holds['embedding']}, output_layer {holds['output_layer']}, "
              f"shared_embedding_or_output_weight() {holds['shared']}")
    print(f"  converter's broadcast: {converted}; with the check: done")
    weight = shared.detach().clone() if shared is not None else torch.zeros(VOCAB, DIM)
    copies = [torch.empty(VOCAB, DIM) for _ in range(stages)]
    dist.all_gather(copies, weight)
    if rank == stages - 1:
        for step, loss in enumerate(losses):
            print(f"step {step}: loss {loss:.4f}")
        print(f"max |first copy - last copy| after {STEPS} steps: "
              f"{(copies[0] - copies[-1]).abs().max().item():.4f}")
    dist.destroy_process_group()
    return {"group_ranks": group_ranks, "in_group": in_group, "built": built,
            "holds": holds, "converted": converted, "start": start, "losses": losses,
            "copies": (copies[0], copies[-1]),
            "parameters": sorted(name for name, _ in stage.named_parameters())}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
