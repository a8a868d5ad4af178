"""The ranks wait for each other: each receives from the other first, so neither sends."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
peer = 1 - dist.get_rank()
print(f"[rank {dist.get_rank()}] waiting for rank {peer}", flush=True)
received = torch.zeros(1)
dist.recv(received, src=peer)
dist.send(torch.ones(1), dst=peer)
