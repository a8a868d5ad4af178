"""What older PyTorch releases do with a tied weight under FSDP, read from their source.

Only the pinned torch runs here (the other releases on PyPI are CUDA builds of several GB).
For the others this script reads single source files of each release's Linux wheel on PyPI
without downloading the wheel (HTTP range requests, as versions/fsdp2_shared_check.py does)
and prints, per release, whether the code that the page "Tied weights with FSDP: meta-device
init and checkpoints" discusses is there:

- FSDP1's constructor refusing a module whose parameters are on the CPU and a GPU even with
  `device_id` (a tied weight that a child unit already moved to the GPU: pytorch/pytorch#83052);
- `torch.nn.Module._apply` swapping a tensor-subclass parameter (FSDP2's DTensor) in place,
  which keeps a tied Parameter one object through `to_empty()`;
- the state-dict helpers' handling of shared parameters in the optimizer state dict
  (pytorch/pytorch#128685) and in the flattened optimizer state dict (pytorch/pytorch#148825).

Writes what it printed to snippets/pipeline/fsdp_tied_sources.txt, which the page includes.

    python3 versions/fsdp_tied_sources.py          # needs PyPI; standard library only
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fsdp2_shared_check import member
from pipeline_removal import fetch

RECORD = Path(__file__).resolve().parent.parent / "snippets" / "pipeline" / "fsdp_tied_sources.txt"
FSDP1_OLD = "torch/distributed/fsdp/fully_sharded_data_parallel.py"  # 1.12: all in one file
FSDP1 = "torch/distributed/fsdp/_init_utils.py"
MODULE = "torch/nn/modules/module.py"
DSD = "torch/distributed/checkpoint/state_dict.py"

# (question, releases, file per release, test of the source)
CHECKS = [
    ("FSDP1 refuses a module on CPU and GPU even with device_id",
     ["1.12.1", "1.13.1", "2.0.1", "2.1.2", "2.13.0"],
     lambda release: FSDP1_OLD if release.startswith("1.") else FSDP1,
     lambda source: b"single device modules" in source
     and b"both CPU and GPU params" not in source),
    ("to_empty() swaps a DTensor parameter in place (nn.Module._apply)",
     ["2.3.1", "2.4.1", "2.6.0", "2.13.0"],
     lambda release: MODULE,
     lambda source: b"is_traceable_wrapper_subclass(param_applied)" in source),
    ("the state-dict helpers map a shared parameter's names (#128685)",
     ["2.3.1", "2.4.0", "2.13.0"],
     lambda release: DSD,
     lambda source: b"shared_params_mapping" in source),
    ("the flattened optimizer state dict handles a shared parameter (#148825)",
     ["2.4.0", "2.5.1", "2.6.0", "2.7.1", "2.13.0"],
     lambda release: DSD,
     lambda source: b'flatten_key = f"{_PG}.{fqn}.{k}"' in source),
]


def wheel(index: dict, release: str) -> tuple[str, int]:
    """The URL and size of the release's x86_64 Linux wheel: for CPython 3.11, or 3.10 for
    releases older than 3.11 wheels."""
    for tag in ("cp311-cp311", "cp310-cp310"):
        for entry in index["files"]:
            name = entry["filename"]
            if (name.startswith(f"torch-{release}-{tag}-") and "manylinux" in name
                    and name.endswith("x86_64.whl")):
                return entry["url"], entry["size"]
    raise SystemExit(f"no x86_64 Linux wheel of torch {release} on PyPI")


def main() -> int:
    index = json.loads(fetch("https://pypi.org/simple/torch/"))
    lines = []
    for question, releases, path_of, holds in CHECKS:
        lines.append(f"{question}:")
        for release in releases:
            url, size = wheel(index, release)
            path = path_of(release)
            source = member(url, size, path)
            lines.append(f"  torch {release} ({path}): {holds(source)}")
            if question == CHECKS[0][0] and holds(source):  # the message it raises
                raised = next(line for line in source.decode().splitlines()
                              if "single device modules" in line)
                lines.append(f"    raises RuntimeError({raised.strip()})")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RECORD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
