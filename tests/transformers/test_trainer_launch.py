"""snippets/transformers/trainer_launch.py: a Trainer script with a ZeRO-3 config. Under a
launcher, on 1 and 2 ranks, the model is partitioned, trained inside a DeepSpeed engine, and the
trained logits equal the same training in one process without DeepSpeed. Started with plain
python (no launcher variables), it stops in from_pretrained with the error the page quotes;
the traceback's frames from from_pretrained down are what snippets/transformers/
trainer_launch_python.txt shows."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, train_causal_lm_in_one_process
from rankrun.runner import ROOT, run_snippet
from rankrun.tolerance import assert_matches

SNIPPET = "snippets/transformers/trainer_launch.py"
TIMEOUT = 600  # Transformers on a loaded 2-core machine
EXAMPLE = example_namespace(SNIPPET)
PLAIN_PYTHON = ROOT / "snippets/transformers/trainer_launch_python.txt"
LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT"}
FRAME = re.compile(r'File ".*?(?:site-packages/)?([\w/.]+\.py)", line \d+, in (\S+)')


def trained_logits_in_one_process():
    """The checkpoint the example saves, three full-batch SGD steps, then the logits."""
    directory = EXAMPLE["save_tiny_llama"]()
    model = EXAMPLE["LlamaForCausalLM"].from_pretrained(directory)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    tokens = torch.stack([row["input_ids"] for row in EXAMPLE["token_dataset"]()])
    train_causal_lm_in_one_process(model, initial, [tokens] * EXAMPLE["STEPS"], EXAMPLE["LR"])
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("world_size", [1, 2])
def test_under_a_launcher_trainer_trains_like_one_process(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=TIMEOUT).check()
    want = trained_logits_in_one_process()
    for rank in range(world_size):
        got = result.returned(rank)
        assert got["engine"] == "DeepSpeedEngine", got["engine"]
        assert_matches(got["logits"], want, f"{world_size} ranks, rank {rank} logits")
    if world_size == 2:
        expect_output(result, output_file(SNIPPET))


class PlainPythonTranscript:
    """What the page shows of the plain-python run: stderr's last line, and the frames from
    the example's from_pretrained call to where it was raised."""

    name, ok = f"python {SNIPPET}", True

    def __init__(self, stderr):
        frames = [f"{function} ({Path(file).name})" for file, function in FRAME.findall(stderr)]
        self.lines = [stderr.rstrip().splitlines()[-1],
                      "  raised in " + " > ".join(frames[frames.index("main (trainer_launch.py)"):])]

    def transcript(self):
        return f"$ python {SNIPPET}\n" + "\n".join(self.lines) + "\n"


@pytest.mark.slow  # a whole example in a fresh interpreter, for the message a reader sees
@pytest.mark.kernel_independent(reason="an example meant to fail: its exception and where, before any number")
def test_plain_python_stops_in_from_pretrained(expect_output):
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run([sys.executable, SNIPPET], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 1, done.stderr[-3000:]
    shown = PlainPythonTranscript(done.stderr)
    assert shown.lines[0] == "ModuleNotFoundError: No module named 'mpi4py'"
    assert "from_pretrained (modeling_utils.py)" in shown.lines[1], shown.lines[1]
    assert shown.lines[1].endswith("mpi_discovery (comm.py)"), shown.lines[1]
    expect_output(shown, PLAIN_PYTHON)
