"""The pinned Mermaid copy the site's diagrams load, fetched by the install.

Material for MkDocs loads Mermaid from unpkg.com unless the page already has it, so the site
ships this pinned copy (not committed: 3.5 MB; hooks/offline.py adds it to the pages that have a
diagram). Fetched with npm, checked against MERMAID_SHA256.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from devtasks.checkout import ROOT, die
from devtasks.supervision import run_step

MERMAID_VERSION = "11.17.2"
MERMAID_SHA256 = "581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8"
MERMAID_DIR = ROOT / "docs" / "assets" / "vendor" / "mermaid"
MERMAID_JS = MERMAID_DIR / "mermaid.min.js"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_mermaid() -> None:
    if MERMAID_JS.is_file() and sha256(MERMAID_JS) == MERMAID_SHA256:
        return
    npm = shutil.which("npm")
    if npm is None:
        die(f"npm is needed once, to fetch mermaid {MERMAID_VERSION} for the site's diagrams")
    with tempfile.TemporaryDirectory() as tmp:
        command = [npm, "pack", f"mermaid@{MERMAID_VERSION}", "--pack-destination", tmp, "--silent"]
        print("+", " ".join(command[:3]), flush=True)
        run_step(command, cwd=tmp, stdout=subprocess.DEVNULL)
        with tarfile.open(Path(tmp) / f"mermaid-{MERMAID_VERSION}.tgz") as archive:
            for member, target in (("package/dist/mermaid.min.js", "mermaid.min.js"),
                                   ("package/LICENSE", "LICENSE")):
                data = archive.extractfile(member).read()
                (Path(tmp) / target).write_bytes(data)
        if sha256(Path(tmp) / "mermaid.min.js") != MERMAID_SHA256:
            die(f"mermaid {MERMAID_VERSION} from npm does not match the pinned hash in devtasks/mermaid.py")
        MERMAID_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "LICENSE", MERMAID_DIR / "LICENSE")
        shutil.copy(Path(tmp) / "mermaid.min.js", MERMAID_JS)
