"""snippets/transformers/import_inside_zero_init.py: a GPT-2 Auto class first imported inside
deepspeed.zero.Init raises torch's TypeError on every rank.

The run uses new interpreters (fresh=True): the warm pool's ranks have imported torch._dynamo
already, and there the build succeeds."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rankrun import marks
from rankrun.pages import output_file
from rankrun.runner import ROOT, free_port, run_snippet

SNIPPET = "snippets/transformers/import_inside_zero_init.py"
# Importing Transformers in new interpreters takes long on a loaded 2-core machine.
TIMEOUT = 600
MESSAGE_START = "Signature mismatch between <function get_new_tensor_fn_for_dtype.<locals>.new_tensor at 0x"
MESSAGE_END = (" and <function tensor_pynew at 0x…>: (cls, *args, **kwargs) -> torch.Tensor != "
               "(cls: type[typing.Any], data: torch.Tensor, requires_grad: bool = False, **kwargs: Any) -> Any")


@marks.message
def test_the_build_raises_torchs_signature_check(expect_output):
    result = run_snippet(SNIPPET, 2, call="main", timeout=TIMEOUT, fresh=True)
    assert not result.ok and result.failed_first
    for rank in result.ranks:
        if rank.exception is None:
            # The runner ends the other ranks once one has failed; under load a rank can be
            # ended while it is still importing or reporting. It must not have done more.
            assert rank.killed_by_runner and rank.rank not in result.failed_first, rank.cause()
            continue
        assert rank.exception["name"] == "TypeError", rank.cause()
        assert rank.exception["message"].startswith(MESSAGE_START), rank.exception["message"]
        assert rank.cause().endswith(MESSAGE_END), rank.cause()
        # The path the page describes: the lazy import of the model's module reaches
        # masking_utils, whose first import of torch._dynamo registers the polyfills.
        traceback = rank.exception["traceback"]
        for frame in ("transformers/models/gpt2/modeling_gpt2.py", "transformers/masking_utils.py",
                      "torch/_dynamo/polyfills/tensor.py", "torch/_dynamo/decorators.py"):
            assert frame in traceback, frame
    expect_output(result, output_file(SNIPPET))


@pytest.mark.slow  # torchrun and two new interpreters importing Transformers
def test_documented_torchrun_command_raises_the_same_message():
    """The command on the page, run for real: torchrun, 2 CPU processes."""
    command = ["torchrun", "--nproc_per_node", "2", SNIPPET]
    assert " ".join(command) in (ROOT / "docs/zero3/transformers.md").read_text()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PET_MASTER_PORT": str(free_port())}
    command[0] = str(Path(sys.executable).parent / "torchrun")  # next to the tests' interpreter
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode != 0
    # Each rank's traceback ends with the message (both ranks write to torchrun's stderr).
    assert done.stderr.count(f"TypeError: {MESSAGE_START}") >= 2, done.stderr[-3000:]
    assert "> and <function tensor_pynew at 0x" in done.stderr, done.stderr[-3000:]
