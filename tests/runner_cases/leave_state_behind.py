"""A badly behaved snippet: it changes every kind of process state it can and cleans up nothing."""
import os
import random
import sys
import warnings

import deepspeed
import torch

import sibling_state

deepspeed.init_distributed(dist_backend="gloo")
torch.distributed.new_group([0, 1])  # an extra group, never destroyed
with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}):
    leftover = torch.nn.Linear(4, 4)  # a partitioned parameter, never released
os.environ["LEFT_BEHIND"] = "yes"
os.chdir("/")
sys.path.insert(0, "/nonexistent")
sys.argv.append("--extra")
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
sibling_state.counter += 1
torch.set_default_dtype(torch.float64)
torch.set_grad_enabled(False)
torch.manual_seed(1234)
random.seed(1234)
warnings.simplefilter("ignore")
print("left state behind")
