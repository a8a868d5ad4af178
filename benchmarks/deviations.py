"""How far each example's numbers are from plain PyTorch, per CPU kernel set, in float32 epsilons.

Runs the example tests (tests/zero3, tests/pipeline, tests/transformers) once per setting with
RANKRUN_DEVIATIONS set, so every comparison made by rankrun.tolerance is recorded, then prints
per example (test module) the largest deviation, in units of float32 eps x the largest
reference value (the tolerance allows rankrun.tolerance.ULPS of them), with the load average.

    .venv/bin/python benchmarks/deviations.py                    # native, default, avx2, avx512, 1 thread
    .venv/bin/python benchmarks/deviations.py --settings default native
    .venv/bin/python benchmarks/deviations.py --summarize runs/   # only print the table of earlier logs

ATEN_CPU_CAPABILITY picks PyTorch's CPU kernels as another CPU would. `avx512` needs a CPU with
AVX-512 (PyTorch does not check: on one without it, expect an illegal instruction); it is left
out unless asked for.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "native": {},
    "default": {"ATEN_CPU_CAPABILITY": "default"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
EXAMPLE_TESTS = ["tests/zero3", "tests/pipeline", "tests/transformers"]


def run(setting: str, logs: Path, extra: list[str]) -> tuple[str, float]:
    log = logs / f"{setting.replace(' ', '-')}.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, **SETTINGS[setting], "RANKRUN_DEVIATIONS": str(log)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", "--no-snippet-coverage", *EXAMPLE_TESTS, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    log.with_suffix(".txt").write_text(done.stdout + done.stderr)  # the failures, if any
    summary = next((line for line in reversed(done.stdout.splitlines()) if " in " in line and "passed" in line
                    or "failed" in line), done.stdout.splitlines()[-1] if done.stdout else "")
    return summary.strip("= "), time.monotonic() - started


def table(logs: Path) -> str:
    worst: dict[str, dict[str, float]] = collections.defaultdict(dict)
    settings = []
    for log in sorted(logs.glob("*.jsonl")):
        setting = log.stem.replace("-", " ")
        settings.append(setting)
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            example = entry["test"].split("::")[0]
            value = entry["deviation"] if entry["deviation"] is not None else float("inf")
            worst[example][setting] = max(worst[example].get(setting, 0.0), value)
    rows = ["| example tests | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    for example in sorted(worst):
        rows.append(f"| {example} | " + " | ".join(f"{worst[example].get(s, float('nan')):.1f}" for s in settings) + " |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    has_avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    default = [s for s in SETTINGS if s != "avx512" or has_avx512]
    parser.add_argument("--settings", nargs="+", default=default, choices=list(SETTINGS))
    parser.add_argument("--summarize", type=Path, help="only print the table of the logs in this directory")
    parser.add_argument("--logs", type=Path, help="keep the logs here (default: a temporary directory)")
    arguments, extra = parser.parse_known_args()
    if arguments.summarize:
        print(table(arguments.summarize))
        return 0
    logs = arguments.logs or Path(tempfile.mkdtemp(prefix="deviations-"))
    logs.mkdir(parents=True, exist_ok=True)
    for setting in arguments.settings:
        load = os.getloadavg()
        summary, seconds = run(setting, logs, extra)
        print(f"{setting:>9}: {summary} ({seconds:.0f} s, load average before {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})",
              flush=True)
    print(f"\nLargest deviation per example, in float32 eps x max|reference| (allowed: 64); logs in {logs}")
    print(table(logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
