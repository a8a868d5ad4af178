#!/usr/bin/env python3
"""The project's two commands, plus the install they share.

    python3 tasks.py serve [mkdocs serve options]   build and serve the site locally
    python3 tasks.py test  [pytest options]         run the whole test suite
    python3 tasks.py test --quick [pytest options]  only the examples and pages (no `slow` tests)

`test` runs pytest on both cores (pytest-xdist: -n 2, a test file's tests on one
worker); pass -n 0 to run in one process.

Both create (or reuse) the virtual environment `.venv/` and install exactly the
versions in `constraints.txt`. Standard library only: this file runs before
anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
CONSTRAINTS = ROOT / "constraints.txt"
STAMP = VENV / ".installed-from"

# Mermaid, for the diagrams on the pages. Material for MkDocs loads it from unpkg.com unless
# the page already has it, so the site ships this pinned copy (not committed: 3.5 MB;
# hooks/offline.py adds it to the pages that have a diagram). Fetched with npm, checked
# against this hash.
MERMAID_VERSION = "11.17.2"
MERMAID_SHA256 = "581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8"
MERMAID_DIR = ROOT / "docs" / "assets" / "vendor" / "mermaid"
MERMAID_JS = MERMAID_DIR / "mermaid.min.js"


def die(message: str) -> None:
    print(f"tasks.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def install_fingerprint() -> str:
    digest = hashlib.sha256()
    for path in (ROOT / "pyproject.toml", CONSTRAINTS, Path(__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def pip_install(*args: str) -> None:
    # Every step goes through the same constraints file: torch can never be
    # resolved on its own (an unpinned torch is a multi-GB CUDA download).
    command = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check",
               "-c", str(CONSTRAINTS), *args]
    print("+", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


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
        subprocess.run(command, cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        with tarfile.open(Path(tmp) / f"mermaid-{MERMAID_VERSION}.tgz") as archive:
            for member, target in (("package/dist/mermaid.min.js", "mermaid.min.js"),
                                   ("package/LICENSE", "LICENSE")):
                data = archive.extractfile(member).read()
                (Path(tmp) / target).write_bytes(data)
        if sha256(Path(tmp) / "mermaid.min.js") != MERMAID_SHA256:
            die(f"mermaid {MERMAID_VERSION} from npm does not match the pinned hash in tasks.py")
        MERMAID_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "LICENSE", MERMAID_DIR / "LICENSE")
        shutil.copy(Path(tmp) / "mermaid.min.js", MERMAID_JS)


def ensure_environment() -> None:
    if sys.version_info[:2] != (3, 11):
        die(f"needs Python 3.11 (the pinned torch 2.13.0 wheel is cp311); this is {sys.version.split()[0]}")
    ensure_mermaid()
    if not PYTHON.exists():
        print(f"creating virtual environment {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    fingerprint = install_fingerprint()
    if STAMP.exists() and STAMP.read_text() == fingerprint:
        return
    # 1. torch first, and the build tools DeepSpeed's setup.py needs.
    pip_install("torch", "setuptools")
    # 2. deepspeed is a source archive whose setup.py imports torch: build it
    #    against the torch installed in step 1, not in an isolated environment
    #    (which would resolve a torch of its own).
    pip_install("--no-build-isolation", "deepspeed")
    # 3. Everything else declared in pyproject.toml.
    pip_install("--no-build-isolation", "-e", ".[test]")
    STAMP.write_text(fingerprint)


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("NO_MKDOCS_2_WARNING", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def run_in_venv(*args: str) -> int:
    return subprocess.run([str(PYTHON), *args], cwd=ROOT, env=environment()).returncode


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"serve", "test", "install"}:
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    ensure_environment()
    if command == "install":
        return 0
    if command == "serve":
        address = "127.0.0.1:8000"
        for i, arg in enumerate(rest):
            if arg.startswith("--dev-addr=") or arg.startswith("-a="):
                address = arg.split("=", 1)[1]
            elif arg in {"--dev-addr", "-a"} and i + 1 < len(rest):
                address = rest[i + 1]
        print(f"Serving the site on http://{address}/  (Ctrl-C stops)", flush=True)
        return run_in_venv("-m", "mkdocs", "serve", *rest)
    return run_in_venv("-m", "pytest", *pytest_arguments(rest))


def pytest_arguments(rest: list[str]) -> list[str]:
    """`rest` with --quick turned into a marker expression and two workers unless -n was given."""
    arguments = []
    for arg in rest:
        if arg == "--quick":
            arguments += ["-m", "not slow"]
        else:
            arguments.append(arg)
    chose_workers = any(arg in {"-n", "--numprocesses"} or arg.startswith(("-n", "--numprocesses="))
                        for arg in arguments)
    if not chose_workers:
        # Both cores of this machine; a file's tests stay on one worker, so its module
        # fixtures are set up once (the workers share one site build: tests/test_site.py).
        arguments = ["-n", "2", "--dist", "loadfile", *arguments]
    return arguments


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as error:
        die(f"install step failed with exit code {error.returncode}: {' '.join(map(str, error.cmd))}")
    except KeyboardInterrupt:
        sys.exit(130)
