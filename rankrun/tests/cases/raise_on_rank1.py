"""Rank 1 raises while rank 0 waits in a collective that will never complete."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("rank 1 gave up")
dist.all_reduce(torch.ones(1))  # rank 0 blocks here
