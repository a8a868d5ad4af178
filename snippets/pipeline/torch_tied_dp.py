"""The tied language model on 2 pipeline stages x 2 data-parallel replicas (4 ranks) with
torch.distributed.pipelining: the tie and the data parallelism kept by hand.

Run on CPU (4 processes: 2 stages, each replicated twice):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 snippets/pipeline/torch_tied_dp.py
(DS_ACCELERATOR is not used here; the command is the same as for the DeepSpeed examples.)
Run and tested here on CPU only; not run on GPUs.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

VOCAB, DIM, SEQ, SEED, LR = 16, 8, 6, 0, 0.5
MICRO_BATCH, MICRO_BATCHES, STEPS, STAGES, REPLICAS = 4, 2, 3, 2, 2


def this_ranks_device():
    """Where this rank computes: the CPU here (then gloo). With an accelerator, e.g. GPUs (not
    run here), the one torchrun's LOCAL_RANK names (then its backend, e.g. NCCL)."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


class TiedLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer1 = nn.Linear(DIM, DIM)
        self.mixer2 = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # the tie: one Parameter, two modules

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer1(self.embed(tokens)))
        hidden = torch.tanh(self.mixer2(hidden))
        return self.head(hidden)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(replica):
    """Replica r's MICRO_BATCHES * MICRO_BATCH sequences: each replica gets other data."""
    generator = torch.Generator().manual_seed(replica)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# --8<-- [start:groups]
def process_groups(rank):
    """Ranks 0, 1 run stage 0 and ranks 2, 3 stage 1 (DeepSpeed's layout); replica = rank % 2.
    Every rank calls new_group for every group, member or not."""
    pipes = [dist.new_group([stage * REPLICAS + r for stage in range(STAGES)])
             for r in range(REPLICAS)]
    replicas = [dist.new_group([s * REPLICAS + r for r in range(REPLICAS)])
                for s in range(STAGES)]
    stage, replica = divmod(rank, REPLICAS)
    # One replica's pipeline: the stages that hold a copy of the tie. Here both do, so the tie
    # group is the pipeline group [replica, REPLICAS + replica].
    return stage, replica, pipes[replica], replicas[stage]
# --8<-- [end:groups]


def main():
    # --8<-- [start:train]
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    rank = dist.get_rank()
    stage_index, replica, tie_group, dp_group = process_groups(rank)
    torch.manual_seed(SEED)
    tokens, targets = (t.to(device) for t in batch(replica))
    pipe = pipeline(TiedLanguageModel().to(device), mb_args=(tokens[:MICRO_BATCH],),
                    split_spec={"mixer2": SplitPoint.BEGINNING})
    module = pipe.get_stage_module(stage_index)
    stage = pipe.build_stage(stage_index, device, group=tie_group)
    schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, loss_fn=cross_entropy)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    (uses,) = pipe.replicated_params
    tied = module.get_parameter(uses[f"submod_pp_{stage_index}"])
    dist.broadcast(tied.data, src=dist.get_process_group_ranks(tie_group)[0], group=tie_group)
    print(f"[rank {rank}] stage {stage_index}, replica {replica}: tie group "
          f"{dist.get_process_group_ranks(tie_group)}, data-parallel group "
          f"{dist.get_process_group_ranks(dp_group)}")

    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        step_losses = []
        if stage_index == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=step_losses)
        # 1. The tie: sum the stages' shares, within this replica's pipeline.
        dist.all_reduce(tied.grad, op=dist.ReduceOp.SUM, group=tie_group)
        # 2. Data parallelism: average every gradient (the tied one too) over the replicas
        #    of this stage.
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=dp_group)
                p.grad /= REPLICAS
        optimizer.step()
        loss = torch.stack(step_losses).mean() if step_losses else torch.zeros((), device=device)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)  # only the last stage's ranks add a loss
        losses.append(loss.item() / REPLICAS)
        copies = [torch.empty_like(tied) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, tied.detach().contiguous())
        difference = max((copy - copies[0]).abs().max().item() for copy in copies)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}, "
                  f"max |copy - rank 0 copy| over all 4 ranks {difference:.4f}")
    # --8<-- [end:train]
    result = {"losses": losses, "weight": tied.detach().clone(), "stage": stage_index,
              "parameters": {name: p.detach().clone() for name, p in module.named_parameters()}}
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
