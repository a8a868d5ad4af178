"""The encoder+decoder tie (encoder embedding, decoder embedding, output head: one weight) on 3
torch.distributed.pipelining stages, the tie kept by hand over the three stages.

Run on CPU (3 processes, one per stage):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 3 snippets/pipeline/torch_three_way.py
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
MICRO_BATCH, MICRO_BATCHES, STEPS = 4, 2, 3


def this_ranks_device():
    """Where this rank computes: the CPU here (then gloo). With an accelerator, e.g. GPUs (not
    run here), the one torchrun's LOCAL_RANK names (then its backend, e.g. NCCL)."""
    if torch.accelerator.is_available():  # pragma: no cover - GPUs, not run here
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
        return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())
    return torch.device("cpu")


# --8<-- [start:model]
class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder_embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.Linear(DIM, DIM)
        self.decoder_embed = nn.Embedding(VOCAB, DIM)
        self.decoder = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        # The three-way tie: one Parameter, three modules.
        self.decoder_embed.weight = self.encoder_embed.weight
        self.head.weight = self.encoder_embed.weight

    def forward(self, tokens):  # tokens: source (SEQ) then decoder input (SEQ - 1)
        # target goes from stage 0 to stage 1; pipelining can only send contiguous tensors
        source, target = tokens[:, :SEQ], tokens[:, SEQ:].contiguous()
        encoded = torch.tanh(self.encoder(self.encoder_embed(source)))
        hidden = self.decoder_embed(target) + encoded.mean(dim=1, keepdim=True)
        return self.head(torch.tanh(self.decoder(hidden)))
# --8<-- [end:model]


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch():
    """A copy task: the decoder reads the source shifted by one and predicts the next token."""
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(0, VOCAB, (MICRO_BATCHES * MICRO_BATCH, SEQ), generator=generator)
    target = torch.roll(source, 1, dims=1)
    return torch.cat([source, target[:, :-1]], dim=1), target[:, 1:]


def main():
    # --8<-- [start:train]
    device = this_ranks_device()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    tokens, targets = (t.to(device) for t in batch())
    pipe = pipeline(EncoderDecoder().to(device), mb_args=(tokens[:MICRO_BATCH],),
                    split_spec={"decoder_embed": SplitPoint.BEGINNING,
                                "head": SplitPoint.BEGINNING})
    (uses,) = pipe.replicated_params  # one entry per stage: {"submod_pp_0": ..., ..._1, ..._2}
    holders = sorted(int(submodule.rsplit("_", 1)[1]) for submodule in uses)
    module = pipe.get_stage_module(rank)
    schedule = ScheduleGPipe(pipe.build_stage(rank, device),
                             n_microbatches=MICRO_BATCHES, loss_fn=cross_entropy)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    tie_group = dist.new_group(holders)  # all three stages
    tied = module.get_parameter(uses[f"submod_pp_{rank}"])
    dist.broadcast(tied.data, src=holders[0], group=tie_group)

    losses, shares = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        step_losses = []
        if rank == 0:
            schedule.step(tokens)
        elif rank == pipe.num_stages - 1:
            schedule.step(target=targets, losses=step_losses)
        else:
            schedule.step()
        shares.append(tied.grad.clone())
        # The tied gradient is the sum of three shares: one all_reduce over the three holders.
        dist.all_reduce(tied.grad, op=dist.ReduceOp.SUM, group=tie_group)
        optimizer.step()
        loss = torch.stack(step_losses).mean() if step_losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=pipe.num_stages - 1)
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    # --8<-- [end:train]
    copies = [torch.empty_like(tied) for _ in holders]
    dist.all_gather(copies, tied.detach().contiguous(), group=tie_group)
    first_shares = [torch.empty_like(tied) for _ in holders]
    dist.all_gather(first_shares, shares[0], group=tie_group)
    if rank == 0:
        print(f"copies of the tied weight: {sorted(uses.items())}")
        print(f"max |copy - stage 0 copy| after {STEPS} steps: "
              f"{max((c - copies[0]).abs().max().item() for c in copies):.4f}")
        norms = ", ".join(f"stage {s} {g.norm().item():.4f}" for s, g in zip(holders, first_shares))
        print(f"step 0, norm of each stage's share of the tied gradient: {norms}; "
              f"of their sum {sum(first_shares).norm().item():.4f}")
    dist.destroy_process_group()
    return {"losses": losses, "uses": dict(uses), "weight": tied.detach().clone(), "copies": copies,
            "first_shares": first_shares,
            "parameters": {name: p.detach().clone() for name, p in module.named_parameters()}}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
