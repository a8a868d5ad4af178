"""Does Liger-Kernel's fused linear cross-entropy run on a CPU?

Makes a scratch virtual environment (outside the repository), installs the pinned torch
through constraints.txt, then liger-kernel and the Triton it needs (both pinned below, with
the same constraints, so that pip never resolves torch), and calls
`liger_fused_linear_cross_entropy` on CPU tensors. Writes what it printed to
snippets/zero3/liger_on_cpu.txt, which docs/zero3/fused-loss.md includes.

    python3 versions/liger_on_cpu.py [SCRATCH_VENV]    # default /tmp/liger-venv; needs the registry

The download is large: triton 3.9.0 is a 286 MB wheel (999 MB installed). Nothing here is
installed into the project's environment.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
RECORD = ROOT / "snippets" / "zero3" / "liger_on_cpu.txt"
LIGER, TRITON = "0.8.5", "3.9.0"  # the newest releases in the registry when this was run

# Run inside the scratch environment: the call a reader's training step makes, on CPU tensors.
CALL = """
import torch, triton, liger_kernel
from importlib.metadata import version
from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
print(f"torch {torch.__version__}, triton {triton.__version__}, liger-kernel {version('liger-kernel')}")
print(f"torch.cuda.is_available(): {torch.cuda.is_available()}")
torch.manual_seed(0)
hidden = torch.randn(6, 8, requires_grad=True)
weight = torch.randn(16, 8, requires_grad=True)
labels = torch.randint(0, 16, (6,))
try:
    loss = liger_fused_linear_cross_entropy(hidden, weight, labels)
    print(f"liger_fused_linear_cross_entropy on CPU tensors: loss {loss.item():.4f}")
except Exception as error:
    print(f"liger_fused_linear_cross_entropy on CPU tensors raised {type(error).__name__}: {error}")
"""


def main(argv: list[str]) -> int:
    scratch = Path(argv[0] if argv else "/tmp/liger-venv")
    python = scratch / "bin" / "python"
    if not python.exists():
        venv.create(scratch, with_pip=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "-c", str(CONSTRAINTS)]
    torch_pin = next(line for line in CONSTRAINTS.read_text().splitlines() if line.startswith("torch=="))
    subprocess.run([*pip, torch_pin, "numpy", "packaging"], check=True)  # torch first, by its pin
    subprocess.run([*pip, f"liger-kernel=={LIGER}", f"triton=={TRITON}"], check=True)
    printed = subprocess.run([str(python), "-W", "ignore", "-c", CALL], check=True,
                             capture_output=True, text=True).stdout
    RECORD.write_text(printed)
    print(printed, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
