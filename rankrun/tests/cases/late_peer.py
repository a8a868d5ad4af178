"""Not a hang: rank 0 waits in a barrier while rank 1 computes for SECONDS, then joins."""
import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    until = time.monotonic() + float(os.environ.get("SECONDS_BUSY", "6"))
    while time.monotonic() < until:
        sum(range(10_000))  # busy, in Python: its stack and CPU time change all along
dist.barrier()
print(f"[rank {dist.get_rank()}] joined", flush=True)
