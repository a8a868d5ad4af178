#!/usr/bin/env python3
"""The project's two commands, plus the install they share.

    python3 tasks.py serve [mkdocs serve options]   build and serve the site locally
    python3 tasks.py test  [pytest options]         run the whole test suite
    python3 tasks.py test --quick [pytest options]  only the examples and pages (no `slow` tests)
    python3 tasks.py notebook [jupyter lab options] open the walkthrough notebook in JupyterLab
    python3 tasks.py matrix [--check] [--help]      the DeepSpeed version matrix (versions/matrix.py)

`test` runs pytest on every core (pytest-xdist: -n os.cpu_count(), a test file's tests
on one worker); pass -n 0 to run in one process. `serve` reuses the notebook's last
executed output while nothing it depends on changed (hooks/notebooks.py).

Both create (or reuse) the virtual environment `.venv/` and install exactly the
versions in `constraints.txt`. Standard library only: this file runs before
anything is installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
CONSTRAINTS = ROOT / "constraints.txt"
STAMP = VENV / ".installed-from"
CREATED = VENV / ".created"  # written once venv.create has finished

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
    # One install at a time: a second command started meanwhile waits here, then finds
    # the environment ready (two first installs at once used to break one of them).
    with open(ROOT / ".venv.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("tasks.py: another install of .venv is running; waiting for it", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        install_locked()


def install_locked() -> None:
    ensure_mermaid()
    if VENV.exists() and not CREATED.exists() and not STAMP.exists():
        # Left by an install that was interrupted while it created the environment
        # (e.g. python without pip): it cannot be repaired in place, so start again.
        # (An environment made before CREATED existed has STAMP and is kept.)
        print(f"tasks.py: {VENV} was left half-made by an interrupted install; creating it again", flush=True)
        shutil.rmtree(VENV)
    if not VENV.exists():
        print(f"creating virtual environment {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
        CREATED.write_text("venv.create finished\n")
    fingerprint = install_fingerprint()
    if STAMP.exists() and STAMP.read_text() == fingerprint:
        problems = environment_problems()
        if not problems:
            return
        print("tasks.py: the environment does not match constraints.txt; repairing it:\n  "
              + "\n  ".join(problems), flush=True)
        STAMP.unlink()
    # 1. torch first, and the build tools DeepSpeed's setup.py needs.
    pip_install("torch", "setuptools")
    # 2. deepspeed is a source archive whose setup.py imports torch: build it
    #    against the torch installed in step 1, not in an isolated environment
    #    (which would resolve a torch of its own).
    pip_install("--no-build-isolation", "deepspeed")
    # 3. Everything else declared in pyproject.toml.
    pip_install("--no-build-isolation", "-e", ".[test,lint,notebook,transformers]")
    problems = environment_problems()
    if problems:
        die("the install finished but the environment still does not match constraints.txt:\n  "
            + "\n  ".join(problems))
    STAMP.write_text(fingerprint)


# Run by the environment's own python: which pinned distributions are missing or at
# another version. About 0.1 s, so every command checks it (a package uninstalled or
# changed by hand in .venv is noticed and repaired, not found later as a crash).
CHECK_PINS = """
import re, sys
from importlib.metadata import distributions
def key(name):
    return re.sub(r"[-_.]+", "-", name).lower()
found = {key(d.metadata["Name"]): d.version for d in distributions()}
problems = []
for line in sys.stdin.read().splitlines():
    name, wanted = line.split("==")
    have = found.get(key(name))
    if have is None:
        problems.append(f"{name}=={wanted}: not installed")
    elif have.split("+")[0] != wanted:
        problems.append(f"{name}=={wanted}: found {have}")
print("\\n".join(problems))
"""


def pinned_distributions() -> list[str]:
    """The `name==version` lines of constraints.txt (every one is installed by the install)."""
    lines = [line.split("#")[0].strip() for line in CONSTRAINTS.read_text().splitlines()]
    return [line for line in lines if "==" in line]


def environment_problems() -> list[str]:
    if not PYTHON.exists():
        return [f"{PYTHON} is missing"]
    done = subprocess.run([str(PYTHON), "-c", CHECK_PINS], input="\n".join(pinned_distributions()),
                          capture_output=True, text=True)
    if done.returncode != 0:
        return [f"{PYTHON} does not run: {done.stderr.strip().splitlines()[-1:] or done.returncode}"]
    return [line for line in done.stdout.splitlines() if line]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("NO_MKDOCS_2_WARNING", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(own_extensions_dir()))
    return env


def own_extensions_dir() -> Path:
    # DeepSpeed compiles its CPU communication op on first use into TORCH_EXTENSIONS_DIR
    # (default ~/.cache/torch_extensions). Environments with different DeepSpeed releases
    # sharing that directory rebuild it back and forth and crash each other
    # (AttributeError: module 'deepspeed_shm_comm' has no attribute 'vector_kernel_level'),
    # so this environment keeps its own, as every environment of the version matrix does.
    return VENV / "torch_extensions"


def matrix(rest: list[str]) -> int:
    # The DeepSpeed version matrix builds its own environments (one per release); it does
    # not need .venv/. Standard library only, like this file.
    if sys.version_info[:2] != (3, 11):
        die(f"needs Python 3.11 (the pinned torch 2.13.0 wheel is cp311); this is {sys.version.split()[0]}")
    from versions import matrix as version_matrix
    return version_matrix.main(rest)


def build_deepspeed_op() -> None:
    """Compile DeepSpeed's CPU communication op for this environment now, if it is not yet.

    DeepSpeed compiles it on its first init: about a minute, several on a loaded machine. Left to
    the tests, the first runs wait for it (torch's file lock) and time out (seen in CI while the
    version matrix ran beside it); here it runs once, with no timeout, before pytest starts."""
    directory = Path(environment()["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    if (directory / "deepspeed_shm_comm.so").exists():
        return
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > 15 * 60:
        lock.unlink()  # left by a build that was killed: torch would wait for it forever
    print("tasks.py: compiling DeepSpeed's CPU communication op for this environment (once; a minute "
          "or more)", flush=True)
    if run_in_venv("-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()") != 0:
        die("compiling DeepSpeed's CPU communication op failed (its output is above)")


def run_in_venv(*args: str) -> int:
    return subprocess.run([str(PYTHON), *args], cwd=ROOT, env=environment()).returncode


def main(argv: list[str]) -> int:
    if argv and argv[0] == "matrix":
        return matrix(argv[1:])
    if not argv or argv[0] not in {"serve", "test", "notebook", "install"}:
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        # Before the install check: a taken port is said at once, not after minutes of work.
        address = "127.0.0.1:8000"
        for i, arg in enumerate(rest):
            if arg.startswith("--dev-addr=") or arg.startswith("-a="):
                address = arg.split("=", 1)[1]
            elif arg in {"--dev-addr", "-a"} and i + 1 < len(rest):
                address = rest[i + 1]
        taken = port_taken(address)
        if taken:
            die(f"cannot serve on http://{address}/: {taken}. Another server (an earlier "
                f"`tasks.py serve`?) may be running there; stop it, or choose another address: "
                f"python3 tasks.py serve --dev-addr 127.0.0.1:8001")
    ensure_environment()
    if command == "install":
        return 0
    if command == "serve":
        print(f"Serving the site on http://{address}/  (Ctrl-C stops)", flush=True)
        return run_in_venv("-m", "mkdocs", "serve", *rest)
    if command == "notebook":
        return subprocess.run(jupyter_lab_command(rest), cwd=ROOT, env=jupyter_environment()).returncode
    build_deepspeed_op()
    return run_in_venv("-m", "pytest", *pytest_arguments(rest))


def port_taken(address: str) -> str | None:
    """Why `mkdocs serve` could not listen on host:port, or None if it can."""
    host, _, port = address.rpartition(":")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as mkdocs' server does
            probe.bind((host.strip("[]"), int(port)))
    except ValueError:
        return f"{address!r} is not host:port"
    except OSError as error:
        return error.strerror or str(error)
    return None


NOTEBOOK = "docs/notebooks/gather-and-release.py"
# JupyterLab opens a jupytext .py as text by default; these settings make its default
# viewer jupytext's notebook, so the walkthrough opens as a notebook at once.
JUPYTERLAB_SETTINGS = ROOT / ".cache" / "jupyterlab-settings"


def jupyter_environment() -> dict[str, str]:
    settings = JUPYTERLAB_SETTINGS / "@jupyterlab" / "docmanager-extension" / "plugin.jupyterlab-settings"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text('{"defaultViewers": {"python": "Jupytext Notebook"}}\n')
    return {**environment(), "JUPYTERLAB_SETTINGS_DIR": str(JUPYTERLAB_SETTINGS)}


def jupyter_lab_command(rest: list[str], root: Path = ROOT) -> list[str]:
    """JupyterLab on the project's environment, rooted at the checkout, opening the notebook."""
    as_root = ["--allow-root"] if os.geteuid() == 0 else []  # containers and CI run as root
    return [str(PYTHON), "-m", "jupyterlab", f"--ServerApp.root_dir={root}", *as_root, *rest, NOTEBOOK]


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
    # `-p no:xdist` turns pytest-xdist off: then there is no -n to pass.
    xdist_off = any(a in {"no:xdist", "-pno:xdist"} for a in arguments)
    if not chose_workers and not xdist_off:
        # One worker per core of this machine; a file's tests stay on one worker, so its
        # module fixtures are set up once (the workers share one site build: tests/test_site.py).
        arguments = ["-n", str(os.cpu_count() or 1), "--dist", "loadfile", *arguments]
    return arguments


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as error:
        die(f"install step failed with exit code {error.returncode}: {' '.join(map(str, error.cmd))}")
    except KeyboardInterrupt:
        sys.exit(130)
