"""Rank 1 hangs forever in plain Python; rank 0 waits for it in a collective."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    while True:
        time.sleep(1)
dist.all_reduce(torch.ones(1))
