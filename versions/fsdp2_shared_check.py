"""Which PyTorch releases refuse a tied parameter in two FSDP2 (fully_shard) groups?

Reads one source file of each release's Linux wheel on PyPI without downloading the wheel
(HTTP range requests: the zip's central directory, then that one member), and prints
whether it raises the "already managed by another FSDP group" ValueError that the tied-layers
page shows (added upstream by pytorch/pytorch#176225 and #176257, after
pytorch/pytorch#176076). Writes what it printed to snippets/pipeline/fsdp2_shared_check.txt,
which docs/pipeline/tied-layers.md includes. Only the pinned torch is run by the tests; this
script reads the other releases' source.

    python3 versions/fsdp2_shared_check.py          # needs PyPI; standard library only
"""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

from pipeline_removal import fetch, wheel

RELEASES = ["2.9.1", "2.10.0", "2.11.0", "2.12.0", "2.13.0"]
MEMBER = "torch/distributed/fsdp/_fully_shard/_fsdp_state.py"
NEEDLES = (b"is shared with a ", b"parameter already managed by another FSDP group")
RECORD = Path(__file__).resolve().parent.parent / "snippets" / "pipeline" / "fsdp2_shared_check.txt"


def central_directory(url: str, size: int) -> bytes:
    tail = fetch(url, size - 65536, size - 1)
    end = tail.rfind(b"PK\x05\x06")
    directory_size, directory_offset = struct.unpack("<II", tail[end + 12:end + 20])
    if directory_offset == 0xFFFFFFFF:
        locator = tail.rfind(b"PK\x06\x07")
        (record,) = struct.unpack("<Q", tail[locator + 8:locator + 16])
        directory_size, directory_offset = struct.unpack("<QQ", fetch(url, record, record + 55)[40:56])
    return fetch(url, directory_offset, directory_offset + directory_size - 1)


def member(url: str, size: int, wanted: str) -> bytes:
    """The uncompressed bytes of one file of a remote zip."""
    directory, at = central_directory(url, size), 0
    while directory[at:at + 4] == b"PK\x01\x02":
        method, = struct.unpack("<H", directory[at + 10:at + 12])
        compressed, = struct.unpack("<I", directory[at + 20:at + 24])
        name_length, extra_length, comment_length = struct.unpack("<HHH", directory[at + 28:at + 34])
        offset, = struct.unpack("<I", directory[at + 42:at + 46])
        name = directory[at + 46:at + 46 + name_length].decode()
        if name == wanted:
            header = fetch(url, offset, offset + 29)
            local_name, local_extra = struct.unpack("<HH", header[26:30])
            start = offset + 30 + local_name + local_extra
            data = fetch(url, start, start + compressed - 1)
            return zlib.decompress(data, -15) if method == 8 else data
        at += 46 + name_length + extra_length + comment_length
    raise SystemExit(f"{wanted} not in {url}")


def main() -> int:
    lines = []
    for release in RELEASES:
        name, url, size = wheel(release)
        source = member(url, size, MEMBER)
        refuses = all(needle in source for needle in NEEDLES)
        lines.append(f"torch {release}: {MEMBER} raises 'already managed by another FSDP "
                     f"group': {refuses}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RECORD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
