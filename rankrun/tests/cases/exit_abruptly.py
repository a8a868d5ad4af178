"""Rank 1 leaves with os._exit(3): no exception, no cleanup, no traceback."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    os._exit(3)
dist.all_reduce(torch.ones(1))
