"""The end of an example without DeepSpeed: all-reduces on gloo, then exit with the group still
referenced, as DeepSpeed's objects keep theirs. Aborts at exit now and then on a loaded machine:
    .venv/bin/python benchmarks/abort_at_exit.py benchmarks/gil_at_finalization/gloo_end.py
With KEEP_GROUP=0 nothing else references the group: destroy_process_group() destroys it and
joins its threads before the interpreter shuts down.
"""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if os.environ.get("KEEP_GROUP", "1") == "1":
    keep = dist.group.WORLD
for _ in range(5):
    mean = torch.ones(64)
    dist.all_reduce(mean)
    value = mean.sum().item()
dist.destroy_process_group()
