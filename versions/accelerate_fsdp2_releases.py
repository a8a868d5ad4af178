"""The two cases of snippets/pipeline/accelerate_fsdp2_tied.py that depend on the accelerate
release, run on the releases around the changes: the tied model with the default
transformer-based auto-wrap (its first step), and the checkpoint with both weights under a
tying config with cpu_ram_efficient_loading. Each release is a pure-Python wheel fetched with
`pip download --no-deps` into a temporary directory and put first on PYTHONPATH, beside the
pinned torch and Transformers of .venv. Writes snippets/pipeline/accelerate_fsdp2_releases.txt.

    .venv/bin/python versions/accelerate_fsdp2_releases.py
"""
import os
import runpy
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "snippets" / "pipeline" / "accelerate_fsdp2_tied.py"
RECORD = ROOT / "snippets" / "pipeline" / "accelerate_fsdp2_releases.txt"
RELEASES = ["1.12.0", "1.13.0", "1.14.0", "1.15.0"]


def ranks():
    import accelerate
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    ex = runpy.run_path(str(EXAMPLE), run_name="reference")
    lines = [f"accelerate {accelerate.__version__}:"]
    try:
        result = ex["train_and_reload"]()
        lines.append(f"  default auto-wrap, tied model: trains (step 0 loss "
                     f"{result['losses'][0]:.4f}), tie {result['tie']}")
    except Exception as error:
        lines.append(f"  default auto-wrap, tied model: {type(error).__name__}: {error}")
    got = ex["both_weights_in_the_file"]()
    lines.append(f"  both weights in the file, config ties: {got['prepared']}")
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def main():
    printed = []
    with tempfile.TemporaryDirectory() as scratch:
        for release in RELEASES:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            f"accelerate=={release}", "-d", scratch], check=True)
            unpacked = Path(scratch) / release
            wheel = next(Path(scratch).glob(f"accelerate-{release}-*.whl"))
            zipfile.ZipFile(wheel).extractall(unpacked)
            run = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_port", "29532", __file__, "--ranks"],
                capture_output=True, text=True, cwd=ROOT, timeout=600,
                env={**os.environ, "PYTHONPATH": str(unpacked), "OMP_NUM_THREADS": "1"})
            if run.returncode:
                raise SystemExit(f"{release}: exit status {run.returncode}\n{run.stderr[-3000:]}")
            printed.append(run.stdout.strip())
    RECORD.write_text("\n".join(printed) + "\n")
    print(RECORD.read_text(), end="")


if __name__ == "__main__":
    if sys.argv[1:] == ["--ranks"]:
        ranks()
    else:
        main()
