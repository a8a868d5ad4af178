"""Runs one all-reduce on gloo, prints, then rank 1 aborts while its interpreter shuts down
(SIGABRT after all its output, as the abort at exit of docs/versions.md did)."""
import os

import torch
import torch.distributed as dist


class AbortsWhenFreed:
    def __del__(self, abort=os.abort):  # os may be cleared by then
        abort()


dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()}: {total.item():.0f}")
if dist.get_rank() == 1:
    freed_at_shutdown = AbortsWhenFreed()
dist.destroy_process_group()
