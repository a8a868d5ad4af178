"""Which PyTorch release removed torch.distributed.pipeline (and its `sync.Pipe`)?

Reads the file list of each release's Linux wheel on PyPI without downloading the wheel (the
zip's central directory, fetched with HTTP range requests), and prints whether the old
package and its replacement, torch.distributed.pipelining, are in it. Writes what it printed
to snippets/pipeline/torch_pipeline_removal.txt, which docs/pipeline/tied-layers-at-scale.md
includes.

    python3 versions/pipeline_removal.py            # needs PyPI; standard library only
"""

from __future__ import annotations

import json
import struct
import sys
import urllib.request
from pathlib import Path

RELEASES = ["2.3.1", "2.4.0"]  # the last release with the package, and the next one
WHEEL_TAG = "cp311-cp311-manylinux"
OLD, NEW = "torch/distributed/pipeline/", "torch/distributed/pipelining/"
RECORD = Path(__file__).resolve().parent.parent / "snippets" / "pipeline" / "torch_pipeline_removal.txt"


def fetch(url: str, first: int | None = None, last: int | None = None) -> bytes:
    headers = {"Accept": "application/vnd.pypi.simple.v1+json"}
    if first is not None:
        headers["Range"] = f"bytes={first}-{last}"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as response:
        return response.read()


def wheel(release: str) -> tuple[str, str, int]:
    """(file name, URL, size) of the release's x86_64 Linux wheel for CPython 3.11."""
    index = json.loads(fetch("https://pypi.org/simple/torch/"))
    for entry in index["files"]:
        name = entry["filename"]
        if name.startswith(f"torch-{release}-{WHEEL_TAG}") and name.endswith("x86_64.whl"):
            return name, entry["url"], entry["size"]
    raise SystemExit(f"no {WHEEL_TAG} x86_64 wheel of torch {release} on PyPI")


def file_names(url: str, size: int) -> list[str]:
    """The names in a remote zip file's central directory (zip64 aware)."""
    tail = fetch(url, size - 65536, size - 1)
    end = tail.rfind(b"PK\x05\x06")
    directory_size, directory_offset = struct.unpack("<II", tail[end + 12:end + 20])
    if directory_offset == 0xFFFFFFFF:
        locator = tail.rfind(b"PK\x06\x07")
        (record,) = struct.unpack("<Q", tail[locator + 8:locator + 16])
        directory_size, directory_offset = struct.unpack("<QQ", fetch(url, record, record + 55)[40:56])
    directory = fetch(url, directory_offset, directory_offset + directory_size - 1)
    names, at = [], 0
    while directory[at:at + 4] == b"PK\x01\x02":
        name_length, extra_length, comment_length = struct.unpack("<HHH", directory[at + 28:at + 34])
        names.append(directory[at + 46:at + 46 + name_length].decode())
        at += 46 + name_length + extra_length + comment_length
    return names


def main() -> int:
    lines = []
    for release in RELEASES:
        name, url, size = wheel(release)
        names = file_names(url, size)
        old = sum(n.startswith(OLD) for n in names)
        new = sum(n.startswith(NEW) for n in names)
        pipe = f"{OLD}sync/pipe.py" in names
        lines.append(f"torch {release} ({name}): {old} files under {OLD} (sync/pipe.py: {pipe}), "
                     f"{new} under {NEW}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RECORD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
