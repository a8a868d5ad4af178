"""Rank 0 raises before it ever joins the process group; rank 1 waits at the rendezvous."""
import os

import torch.distributed as dist

if os.environ["RANK"] == "0":
    raise KeyError("no such config key")
dist.init_process_group("gloo")  # rank 1 blocks here, waiting for rank 0
