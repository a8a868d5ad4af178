"""The end of an example without DeepSpeed: all-reduces on gloo, then exit with the group still
referenced, as DeepSpeed's objects keep theirs. On a loaded machine it aborts at exit now and
then with its old ending (ENDING=destroy, the default), never with the examples' new one:
    ENDING=destroy .venv/bin/python benchmarks/abort_at_exit.py benchmarks/gil_at_finalization/gloo_end.py
    ENDING=exit .venv/bin/python benchmarks/abort_at_exit.py benchmarks/gil_at_finalization/gloo_end.py
"""
import os
import sys

import torch
import torch.distributed as dist

ENDING = os.environ.get("ENDING", "destroy")
dist.init_process_group("gloo")
keep = dist.group.WORLD  # as DeepSpeed's objects keep the groups
t = torch.ones(64)
for _ in range(5):
    mean = t.clone()
    dist.all_reduce(mean)
    value = mean.sum().item()
dist.destroy_process_group()
if ENDING == "exit":  # the examples' ending
    sys.stdout.flush()
    os._exit(0)
