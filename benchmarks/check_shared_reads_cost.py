"""Benchmark: time and memory of check_shared_reads.py on scaled-down Llama configurations.

    .venv/bin/python benchmarks/check_shared_reads_cost.py > snippets/zero3/check_shared_reads_cost.txt

Each configuration is checked in a fresh process (one CPU process, 3 steps, batch 1 x 32
tokens): the wall time of check_shared_reads() alone, and the process's peak resident memory.
Figures vary from run to run; the pages show one run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [  # (layers, hidden, intermediate, heads, vocab)
    (2, 64, 128, 4, 256),
    (4, 256, 688, 8, 4096),
    (4, 512, 1376, 8, 32000),
]
ONE = r"""
import json, resource, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig
from rankrun.reference import example_namespace
checker = example_namespace("snippets/zero3/check_shared_reads.py")
DS_CONFIG, check_shared_reads = checker["DS_CONFIG"], checker["check_shared_reads"]
layers, hidden, inter, heads, vocab = json.loads(sys.argv[1])
config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                     num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab)
keep = HfDeepSpeedConfig(DS_CONFIG)
tokens = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
loop = lambda engine, inputs: engine(input_ids=inputs[0], labels=inputs[0]).loss
started = time.perf_counter()
found = check_shared_reads(lambda: LlamaForCausalLM(config), (tokens,), loop=loop)
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "phases": sorted({f.phase for f in found}), "findings": len(found)}))
"""


def main():
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    print("LlamaForCausalLM, scaled down; check_shared_reads(), 3 steps, one CPU process")
    for layers, hidden, inter, heads, vocab in CONFIGS:
        done = subprocess.run([sys.executable, "-c", ONE, json.dumps([layers, hidden, inter, heads, vocab])],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        line = [l for l in done.stdout.splitlines() if l.startswith("{")]
        if done.returncode or not line:
            print(f"{layers} layers, hidden {hidden}: failed: {done.stderr[-500:]}")
            continue
        got = json.loads(line[-1])
        params = layers * (4 * hidden * hidden + 3 * hidden * inter) + 2 * vocab * hidden
        print(f"{layers} layers, hidden {hidden}, vocab {vocab} (about {params / 1e6:.1f} M parameters): "
              f"{got['seconds']:.1f} s, peak memory {got['peak_mib']:.0f} MiB; "
              f"{got['findings']} findings, phases {got['phases']}")
    print(f"load average while measuring: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
