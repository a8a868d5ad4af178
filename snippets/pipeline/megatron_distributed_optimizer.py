"""Megatron Core's DistributedDataParallel on 2 pipeline stages x 2 replicas: the tied weight's
gradient after finalize_model_grads, as each replica's optimizer would apply it, with an
all-reduce over the replicas and with the distributed optimizer's reduce-scatter.

Run on CPU (4 processes: 2 stages, each replicated twice; with 2, one replica):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 snippets/pipeline/megatron_distributed_optimizer.py
(DS_ACCELERATOR is not used here; the command is the one of the DeepSpeed examples.)
Run and tested here on CPU only, over gloo, with megatron-core 0.16.1; not run on GPUs.
"""
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as MegatronDDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer

from megatron_embedding_group import (DIM, MICRO_BATCH, MICRO_BATCHES, SEED, SEQ, VOCAB,
                                      Stage, TiedLanguageModel, cross_entropy,
                                      tiny_gpt_config)

if not torch.cuda.is_available():
    # CPU only: Megatron's DDP puts its gradient buffer on torch.cuda.current_device().
    torch.cuda.current_device = lambda: "cpu"


def micro_batches(replica):
    """Replica r's MICRO_BATCHES (tokens, next tokens) pairs: other data per replica."""
    generator = torch.Generator().manual_seed(replica)
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:configs]
CONFIGS = {  # name: (use_distributed_optimizer, shared_embedding set on the tied weight)
    "all-reduce over the replicas": (False, False),
    "distributed optimizer, shared_embedding set": (True, True),
    "distributed optimizer, shared_embedding not set": (True, False),
}
# --8<-- [end:configs]


# --8<-- [start:applied]
def applied_gradient(ddp, weight, distributed):
    """The tied weight's gradient as this stage's optimizer would apply it: all of
    main_grad, or with the distributed optimizer each replica's own shard of it (the
    shard map is DistributedOptimizer's), summed over the replicas."""
    if not distributed:
        return weight.main_grad.clone(), None
    buffer = ddp.buffers[0]
    bucket = buffer.param_index_map[weight][2]
    ranges = DistributedOptimizer._build_model_gbuf_range(buffer, bucket)["param_map"]
    owned = torch.zeros(weight.numel())
    shard = ranges[weight]["param"] if weight in ranges else None
    if shard is not None:
        owned[shard.start:shard.end] = weight.main_grad.view(-1)[shard.start:shard.end]
    dist.all_reduce(owned, group=parallel_state.get_data_parallel_group())
    return owned.view_as(weight), (shard.start, shard.end) if shard else None
# --8<-- [end:applied]


# --8<-- [start:step]
def one_step(config, distributed, tagged):
    first = parallel_state.is_pipeline_first_stage()
    torch.manual_seed(SEED)
    stage = Stage(TiedLanguageModel(), first)
    weight = stage.shared_embedding_or_output_weight()
    if not first:  # Megatron's start-up tie: zeros, then the sum over the group
        weight.data.fill_(0)
    dist.all_reduce(weight.data, group=parallel_state.get_embedding_group())
    if tagged:  # what Megatron's LanguageModule sets on both copies
        weight.shared_embedding = True
    ddp = MegatronDDP(config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed), stage)
    ddp.zero_grad_buffer()
    previous = parallel_state.get_pipeline_model_parallel_prev_rank()
    following = parallel_state.get_pipeline_model_parallel_next_rank()
    replica = parallel_state.get_data_parallel_rank()
    for x, y in micro_batches(replica):
        if first:
            hidden = ddp(x)
            dist.send(hidden.detach(), dst=following)
            grad = torch.empty_like(hidden)
            dist.recv(grad, src=following)
            hidden.backward(grad)
        else:
            hidden = torch.empty(MICRO_BATCH, SEQ, DIM)
            dist.recv(hidden, src=previous)
            hidden.requires_grad_()
            (cross_entropy(ddp(hidden), y) / MICRO_BATCHES).backward()
            dist.send(hidden.grad, dst=previous)
    # Megatron's order: the replicas' all-reduce or reduce-scatter first, then the
    # all-reduce of the tied weight's gradient over the embedding group.
    finalize_model_grads([ddp])
    return ddp, weight
# --8<-- [end:step]


def main():
    dist.init_process_group()  # no backend named: gloo for CPU tensors
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=2)
    config = tiny_gpt_config()
    stage_id = parallel_state.get_pipeline_model_parallel_rank()
    replica = parallel_state.get_data_parallel_rank()
    results = {}
    # --8<-- [start:main]
    for name, (distributed, tagged) in CONFIGS.items():
        ddp, weight = one_step(config, distributed, tagged)
        applied, shard = applied_gradient(ddp, weight, distributed)
        every = [None] * world
        dist.all_gather_object(every, (stage_id, replica, shard, applied))
        results[name] = every
        if rank == 0:
            print(name)
            if distributed:
                print("  elements of the tied weight each replica updates: " + ", ".join(
                    f"stage {s} replica {r} {owned[0]} to {owned[1]}" if owned
                    else f"stage {s} replica {r} none" for s, r, owned, _ in every))
            stage0, stage1 = (g for s, r, _, g in every if r == 0)
            print(f"  norm of the gradient each stage applies: stage 0 "
                  f"{stage0.norm():.4f}, stage 1 {stage1.norm():.4f}; max |difference| "
                  f"{(stage0 - stage1).abs().max():.4f}")
    # --8<-- [end:main]
    try:  # Megatron's own distributed optimizer, on this CPU
        get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.5,
                                               use_distributed_optimizer=True), [ddp])
        refused = None  # pragma: no cover (with CUDA, not run here)
    except AssertionError as error:
        refused = f"{type(error).__name__}: {error}"
    if rank == 0:
        print(f"get_megatron_optimizer(use_distributed_optimizer=True) on CPU: {refused}")
    dist.destroy_process_group()
    return {"results": results, "refused": refused}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
