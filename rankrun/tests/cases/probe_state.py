"""Prints the process state a snippet starts with; a fresh process and a pool worker must agree."""
import logging
import os
import random
import resource
import signal
import sys
import threading
import warnings

import deepspeed
import torch

import sibling_state

print("distributed initialized:", torch.distributed.is_initialized())
print("deepspeed comm backend:", deepspeed.comm.comm.cdb)
print("LEFT_BEHIND:", os.environ.get("LEFT_BEHIND"))
print("cwd is the project:", os.path.isfile("mkdocs.yml"))
print("sys.path[0] is my folder:", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("/nonexistent on sys.path:", "/nonexistent" in sys.path)
print("sibling counter:", sibling_state.counter)
print("argv is just me:", sys.argv == [__file__] or sys.argv[1:] == [])
print("threads:", torch.get_num_threads())
print("deterministic algorithms:", torch.are_deterministic_algorithms_enabled())
print("default dtype:", torch.get_default_dtype())
print("grad enabled:", torch.is_grad_enabled())
# A fresh process seeds torch and random from the OS: a seed left by another snippet must not show.
print("torch seeded with 1234:", torch.initial_seed() == 1234)
print("random seeded with 1234:", random.getstate() == random.Random(1234).getstate())
print("warning filters:", len(warnings.filters))
print("sys.stdout is the real one:", sys.stdout is sys.__stdout__)
print("relu of 1:", torch.nn.functional.relu(torch.ones(1)).item())
print("print precision:", torch._tensor_str.PRINT_OPTS.precision)
print("matmul precision:", torch.get_float32_matmul_precision())
umask = os.umask(0o022)
os.umask(umask)
print("umask:", oct(umask))
print("recursion limit:", sys.getrecursionlimit())
print("deepspeed logger level:", logging.getLogger("deepspeed").level,
      "root logger level:", logging.getLogger().level)
print("global forward hooks:", len(torch.nn.modules.module._global_forward_hooks))
print("anomaly detection:", torch.is_anomaly_enabled())
print("open files limit:", resource.getrlimit(resource.RLIMIT_NOFILE)[0] != 256)
print("SIGUSR2 handler is the default:", signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL)
print("SIGHUP blocked:", signal.SIGHUP in signal.pthread_sigmask(signal.SIG_BLOCK, []))
print("Python threads:", threading.active_count())
deepspeed.init_distributed(dist_backend="gloo")
with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}):
    layer = torch.nn.Linear(4, 4)
print("partitioned weight shape:", tuple(layer.weight.shape), "full:", tuple(layer.weight.ds_shape))
print("world size:", torch.distributed.get_world_size())
torch.distributed.destroy_process_group()
