"""Rank 1 starts two processes and leaves them running: a daemon in its own session, and a
sleep whose parent (a shell) ends at once, so it is orphaned. Rank 0 starts nothing."""
import os
import subprocess

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    subprocess.Popen(["sleep", "301"], start_new_session=True)
    subprocess.run(["sh", "-c", "sleep 302 & echo $! > /dev/null"], check=True)  # the shell exits, sleep stays
dist.barrier()
dist.destroy_process_group()
print(f"rank {dist.get_rank() if dist.is_initialized() else os.environ['RANK']} done")
