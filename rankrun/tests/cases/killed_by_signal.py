"""Rank 1 is killed by SIGKILL (as the kernel's OOM killer would); rank 0 waits for it."""
import os
import signal

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(torch.ones(1))
