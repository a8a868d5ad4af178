"""Which Transformers releases raise `'Parameter' object has no attribute 'ds_numel'`?

Trainer.train() logs "Number of trainable parameters" with trainer_pt_utils'
get_model_param_count. Transformers 4.28.0 to 4.31.0 read `p.ds_numel` of every parameter
whenever a ZeRO-3 config is alive; 4.32.0 falls back to numel() (huggingface/transformers#24942).
This installs each release (with the tokenizers and huggingface_hub releases it requires) into a
scratch folder outside the repository, without dependencies, and runs, with the project's
Python and pinned torch, that function on a model built before ZeRO-3 was configured (so never
partitioned) while an HfDeepSpeedConfig is alive. Writes what it printed to
snippets/transformers/trainer_param_count.txt, which docs/zero3/quantized-models.md includes.

    python3 versions/trainer_param_count.py [SCRATCH]    # default /tmp/trainer-param-count

Nothing is installed into the project's environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
RECORD = ROOT / "snippets" / "transformers" / "trainer_param_count.txt"
RELEASES = ["4.31.0", "4.32.0"]  # the last release that raises, and the first that does not
WITH = ["tokenizers==0.13.3", "huggingface_hub==0.17.3"]  # what both releases require

# Run with the release on PYTHONPATH: the function Trainer.train() logs its count with.
CALL = """
import torch, transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.deepspeed import HfDeepSpeedConfig
from transformers.trainer_pt_utils import get_model_param_count
config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                     num_hidden_layers=1, num_attention_heads=2)
model = LlamaForCausalLM(config)  # built before ZeRO-3 is configured: never partitioned
zero3 = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                           "zero_optimization": {"stage": 3}})
print(f"transformers {transformers.__version__}, torch {torch.__version__}")
try:
    count = get_model_param_count(model, trainable_only=True)
    print(f"  get_model_param_count(model, trainable_only=True): {count:,}")
except Exception as error:
    print(f"  get_model_param_count(model, trainable_only=True) raised "
          f"{type(error).__name__}: {error}")
"""


def main(argv: list[str]) -> int:
    scratch = Path(argv[0] if argv else "/tmp/trainer-param-count")
    printed = []
    for release in RELEASES:
        target = scratch / release
        if not (target / "transformers").exists():
            subprocess.run([str(PYTHON), "-m", "pip", "install", "--quiet", "--no-deps",
                            "--target", str(target), f"transformers=={release}", *WITH],
                           check=True)
        env = {**os.environ, "PYTHONPATH": str(target)}
        printed.append(subprocess.run([str(PYTHON), "-W", "ignore", "-c", CALL], env=env,
                                      check=True, capture_output=True, text=True).stdout)
    RECORD.write_text("".join(printed))
    print("".join(printed), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
