"""What a reader sees when they run an example with plain `python` instead of torchrun.

The snippets carry no code to catch this, so the reader gets the library's own error;
docs/testing.md quotes these messages and this test keeps them true.
"""

import os
import subprocess
import sys

import pytest

from rankrun.runner import ROOT

pytestmark = pytest.mark.slow  # two plain-python runs of whole examples, for the messages a reader sees

TORCHRUN_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


@pytest.mark.parametrize("snippet, last_line", [
    ("snippets/zero3/language_model.py", "ModuleNotFoundError: No module named 'mpi4py'"),
    ("snippets/pipeline/torch_tied.py",
     "ValueError: Error initializing torch.distributed using env:// rendezvous: "
     "environment variable RANK expected, but not set"),
])
def test_plain_python_stops_with_the_librarys_error(snippet, last_line):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run([sys.executable, snippet], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.rstrip().splitlines()[-1] == last_line
    assert last_line in (ROOT / "docs" / "testing.md").read_text()
