"""Not part of the suite: rankrun/tests/test_runner_faults.py runs this file in a child pytest and interrupts it."""
import os
from pathlib import Path

from rankrun.runner import run_snippet


def test_run_until_interrupted():
    run_snippet(Path(__file__).parent / "hang_reporting_pids.py", world_size=2, timeout=600,
                fresh=os.environ["RUN_FRESH"] == "1")
