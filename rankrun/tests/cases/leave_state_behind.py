"""A badly behaved snippet: it changes every kind of process state it can and cleans up nothing."""
import io
import logging
import os
import random
import resource
import signal
import sys
import threading
import time
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
print("left state behind", flush=True)
# What a worker that runs the next snippet would still carry.
torch.nn.functional.relu = lambda x, inplace=False: x * 0  # a monkeypatch
torch.set_printoptions(precision=1)
torch.set_float32_matmul_precision("medium")
os.umask(0o077)
sys.setrecursionlimit(123456)
logging.getLogger("deepspeed").setLevel(logging.CRITICAL)
logging.getLogger().setLevel(logging.DEBUG)
torch.nn.modules.module.register_module_forward_hook(lambda module, inputs, output: None)
torch.autograd.set_detect_anomaly(True)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
signal.signal(signal.SIGUSR2, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})


def chatter():
    while True:
        print("a thread of leave_state_behind.py still prints", flush=True)
        time.sleep(0.01)


threading.Thread(target=chatter, daemon=True).start()
sys.stdout = io.StringIO()  # and the next snippet's prints would vanish
