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

import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
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


# Running the commands' children. Ctrl-C at the terminal reaches every process of the
# foreground job, the child (pytest, mkdocs, pip) included, and the child ends in its own way:
# pytest prints its summary and removes its temporary files, mkdocs stops its server. So
# tasks.py does not stop or kill it (subprocess.run kills its child a quarter of a second
# after a KeyboardInterrupt): it waits for it. A signal sent to tasks.py alone (`kill -INT`,
# a CI timeout's SIGTERM) is passed on to the child, which then ends the same way.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SI_KERNEL = 0x80  # siginfo si_code of a signal the terminal sent to the whole job
interrupted = False  # a SIGINT arrived while a child ran


def run_child(command: list[str], **options) -> int:
    """Run `command` and wait for it to end, however it is interrupted; its exit status, or
    128 + N when it was killed by signal N (as a shell reports it)."""
    global interrupted
    watched = {signal.SIGCHLD, *FORWARDED}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, watched)  # the child gets them unblocked:
    try:                                                          # see preexec_fn
        process = subprocess.Popen(command, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK, before),
                                   **options)
        while process.poll() is None:
            info = signal.sigtimedwait(watched, 0.5)
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            interrupted |= info.si_signo == signal.SIGINT
            if info.si_code != SI_KERNEL:
                process.send_signal(info.si_signo)
        end_what_is_left()
        while (info := signal.sigtimedwait(FORWARDED, 0)) is not None:  # came as it ended
            interrupted |= info.si_signo == signal.SIGINT
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    return process.returncode if process.returncode >= 0 else 128 - process.returncode


def become_subreaper() -> None:
    """Processes the child leaves behind become this process's children, not init's (Linux):
    a notebook kernel runs in a session of its own, which no Ctrl-C at the terminal reaches,
    and its cell's run went on for half a minute after the build that started it was gone."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def children() -> list[tuple[int, str]]:
    """(pid, state) of this process's children, from /proc; none where there is no /proc."""
    found = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == os.getpid():
                found.append((int(entry.name), fields[0]))
    return found


def end_what_is_left(grace: float = 5.0) -> None:
    """End the processes the child left behind (they are ours: become_subreaper): SIGTERM,
    then SIGKILL after `grace` seconds; what they leave in turn is ended the same way."""
    signalled: dict[int, float] = {}
    stop = time.monotonic() + 3 * grace
    while (left := children()) and time.monotonic() < stop:
        for pid, state in left:
            try:
                if state == "Z":
                    os.waitpid(pid, os.WNOHANG)
                elif pid not in signalled:
                    os.kill(pid, signal.SIGTERM)
                    signalled[pid] = time.monotonic()
                elif time.monotonic() - signalled[pid] > grace:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, ChildProcessError):
                pass
        time.sleep(0.05)


def run_step(command: list[str], **options) -> None:
    """An install step: stop (exit 130) if it was interrupted, fail if it failed."""
    code = run_child(command, cwd=options.pop("cwd", ROOT), **options)
    if interrupted:
        raise KeyboardInterrupt
    if code != 0:
        raise subprocess.CalledProcessError(code, command)


# Every temporary file of a command (pytest's session directory, mkdocs serve's site, the
# notebook's run and its torchrun logs, ensurepip's wheels) goes into one directory per
# command, removed when it ends; the next command removes those of commands that were killed.
COMMAND_TMP_PREFIX = "tasks-py-"


def own_temporary_directory() -> Path:
    base = Path(tempfile.gettempdir())
    for directory in base.glob(f"{COMMAND_TMP_PREFIX}*"):
        pid = directory.name[len(COMMAND_TMP_PREFIX):]
        if pid.isdigit() and not pid_exists(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)
    directory = base / f"{COMMAND_TMP_PREFIX}{os.getpid()}"
    directory.mkdir(exist_ok=True)
    return directory


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    run_step(command)


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
        venv.create(VENV, with_pip=False)
        # ensurepip as venv.create(with_pip=True) runs it, but as a child that a Ctrl-C lets
        # finish its cleanup (its wheels go to the command's temporary directory).
        env = {key: value for key, value in os.environ.items() if key not in {"PYTHONHOME", "PYTHONPATH"}}
        run_step([str(PYTHON), "-m", "ensurepip", "--upgrade", "--default-pip"], cwd=VENV,
                 env={**env, "VIRTUAL_ENV": str(VENV)}, stdout=subprocess.DEVNULL)
        CREATED.write_text("venv.create finished\n")
    fingerprint = install_fingerprint()
    if STAMP.exists() and STAMP.read_text() == fingerprint:
        problems = environment_problems()
        if not problems:
            return
        print("tasks.py: the environment does not match constraints.txt; repairing it:\n  "
              + "\n  ".join(problems), flush=True)
        STAMP.unlink()
        # pip takes a distribution whose metadata is there for installed, files or not:
        # reinstall those whose files are gone, exactly at their pinned version.
        gone = [problem.split(":")[0] for problem in problems if FILES_GONE in problem]
        if gone:
            pip_install("--force-reinstall", "--no-deps", *gone)
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


# Run by the environment's own python (isolated: -I, so the checkout itself is not on
# sys.path): which pinned distributions are missing, at another version, or installed with
# their files gone (a top-level module of theirs cannot be found), and whether the project
# itself is installed from this checkout with the entry points pyproject.toml declares
# (without them pytest runs without the harness's plugin). About 0.2 s, so every command
# checks it: a package uninstalled, changed or deleted by hand in .venv is noticed and
# repaired, not found later as a crash.
FILES_GONE = "its files are gone"
CHECK_ENVIRONMENT = """
import json, os, re, sys
from importlib.util import find_spec
from pathlib import Path
def key(name):
    return re.sub(r"[-_.]+", "-", name).lower()
# The installed distributions from their .dist-info directories' names (name-version): reading
# every METADATA file instead would take most of the half second.
found = {}
for directory in sys.path:
    try:
        entries = list(os.scandir(directory))
    except OSError:
        continue
    for entry in entries:
        if entry.name.endswith(".dist-info"):
            name, _, version = entry.name[:-len(".dist-info")].partition("-")
            found.setdefault(key(name), (version, Path(entry.path)))  # the first on sys.path, as import
def installed(name):
    if key(name) in found:
        return found[key(name)]
    from importlib.metadata import distribution, PackageNotFoundError  # slower: only for a miss
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        return None
    return dist.version, Path(str(dist._path))
def read(where, name):
    try:
        return (where / name).read_text()
    except OSError:
        return ""
def top_level(where):
    # {module: whether it is a regular package (has __init__.py)}, from top_level.txt if the
    # distribution has one, else from the files it installed (RECORD).
    names = read(where, "top_level.txt").split()
    record = read(where, "RECORD")
    if names:
        # top_level.txt can name a module the wheel does not install at the top (xxhash's lists
        # _xxhash, which lives in xxhash/): only a name RECORD has files for is checked.
        installs = lambda name: re.search(rf'^"?{re.escape(name)}(/|\\.[^/,]*,)', record, re.M)
        return {name: None for name in names if name.isidentifier() and (not record or installs(name))}
    modules = {}
    for first, rest in re.findall(r'^"?([^/,\\n]+)(?:/([^,\\n]*))?', read(where, "RECORD"), re.M):
        if rest and first.isidentifier():
            modules[first] = modules.get(first, False) or rest == "__init__.py"
        elif not rest and first.endswith((".py", ".so")) and first.split(".")[0].isidentifier():
            modules.setdefault(first.split(".")[0], False)
    return modules
def entry_points(where):
    points, group = set(), None
    for line in read(where, "entry_points.txt").splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            group = line[1:-1]
        elif "=" in line and group:
            name, _, value = line.partition("=")
            points.add((group, name.strip(), value.strip()))
    return points
def gone(where, module, package):
    spec = find_spec(module)
    if spec is None:
        return True
    if spec.origin not in (None, "namespace"):
        return False
    if package is None:  # a namespace package now: was it one?
        package = f"{module}/__init__.py," in read(where, "RECORD")
    return package
wanted = json.load(sys.stdin)
problems = []
for line in wanted["pins"]:
    name, version = line.split("==")
    have = installed(name)
    if have is None:
        problems.append(f"{name}=={version}: not installed")
    elif have[0].split("+")[0] != version:
        problems.append(f"{name}=={version}: found {have[0]}")
    else:
        missing = [module for module, package in sorted(top_level(have[1]).items()) if gone(have[1], module, package)]
        if missing:
            problems.append(f"{name}=={version}: installed, but {FILES_GONE} (no module {missing[0]!r})")
project = wanted["project"]
have = installed(project["name"])
if have is None:
    problems.append(f"{project['name']} (this project, pip install -e .): not installed")
else:
    points = entry_points(have[1])
    for group, name, value in map(tuple, project["entry_points"]):
        module = value.split(":")[0]
        spec = find_spec(module.split(".")[0])
        origin = (spec.origin or "") if spec else ""
        if (group, name, value) not in points:
            problems.append(f"{project['name']} (this project): entry point {group}:{name} = {value} is not installed")
        elif not (origin and os.path.realpath(origin).startswith(project["root"] + os.sep)):
            problems.append(f"{project['name']} (this project): {module} is imported from "
                            f"{origin or 'nowhere'}, not from {project['root']}")
print("\\n".join(problems))
""".replace("{FILES_GONE}", FILES_GONE)


def pinned_distributions() -> list[str]:
    """The `name==version` lines of constraints.txt (every one is installed by the install),
    read by the project's one constraints parser (rankrun.project: standard library only)."""
    from rankrun.project import pins

    return [f"{name}=={version}" for name, version in pins(CONSTRAINTS).items()]


def project_declaration() -> dict:
    """The project's name and the entry points pyproject.toml declares, as the check reads them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    entry_points = [["console_scripts", name, value] for name, value in project.get("scripts", {}).items()]
    for group, points in project.get("entry-points", {}).items():
        entry_points += [[group, name, value] for name, value in points.items()]
    return {"name": project["name"], "entry_points": entry_points, "root": os.path.realpath(ROOT)}


def environment_problems() -> list[str]:
    if not PYTHON.exists():
        return [f"{PYTHON} is missing"]
    wanted = {"pins": pinned_distributions(), "project": project_declaration()}
    done = subprocess.run([str(PYTHON), "-I", "-c", CHECK_ENVIRONMENT], input=json.dumps(wanted),
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return [f"{PYTHON} does not run: {done.stderr.strip().splitlines()[-1:] or done.returncode}"]
    return [line for line in done.stdout.splitlines() if line]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("NO_MKDOCS_2_WARNING", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(own_extensions_dir()))
    # The environment's bin/ first on PATH, as `source .venv/bin/activate` puts it for the README's
    # torchrun: torch builds DeepSpeed's op with the first `ninja` on PATH. The venv's ninja (1.13,
    # rapidhash, .ninja_log v7) and a system one (1.11 here, MurmurHash2, v5) hash a command
    # differently, so each finds the other's log stale and rebuilds the op in place (30 s or
    # more) every time a reader switches between `tasks.py test` and the activated torchrun.
    bin_dir = str(VENV / "bin")
    if env.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        env["PATH"] = os.pathsep.join([bin_dir, *filter(None, [env.get("PATH")])])
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
        if interrupted:
            raise KeyboardInterrupt
        die("compiling DeepSpeed's CPU communication op failed (its output is above)")


def run_in_venv(*args: str) -> int:
    return run_child([str(PYTHON), *args], cwd=ROOT, env=environment())


COMMANDS = ("serve", "test", "notebook", "matrix", "install")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] in {"-h", "--help", "help"}:
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        die(f"unknown command {command!r}; the commands are {', '.join(COMMANDS[:-1])} "
            f"(python3 tasks.py --help says what each does)")
    become_subreaper()
    # One temporary directory for everything this command starts (see own_temporary_directory).
    temporary = own_temporary_directory()
    os.environ["TMPDIR"] = str(temporary)
    tempfile.tempdir = None  # tempfile caches the directory it found first
    try:
        return run_command(command, rest)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def run_command(command: str, rest: list[str]) -> int:
    if command == "matrix":
        return matrix(rest)
    if command == "serve":
        # Before the install check: a bad or taken address is said at once, not after minutes of work.
        address = serve_address(rest)
    ensure_environment()
    if command == "install":
        return 0
    if command == "serve":
        if "-h" in rest or "--help" in rest:
            return run_in_venv("-m", "mkdocs", "serve", *rest)
        if run_in_venv("-c", CHECK_SERVE_OPTIONS, *rest) != 0:  # it said why, in one line
            return 130 if interrupted else 2
        print(f"Serving the site on http://{address}/  (Ctrl-C stops)", flush=True)
        return run_in_venv("-m", "mkdocs", "serve", *rest)
    if command == "notebook":
        return run_child(jupyter_lab_command(rest), cwd=ROOT, env=jupyter_environment())
    build_deepspeed_op()
    return run_in_venv("-m", "pytest", *pytest_arguments(rest))


# `mkdocs serve`'s own parsing of the options, without serving: an unknown option or a missing
# value is said in one line before the build starts.
CHECK_SERVE_OPTIONS = """
import sys, click
from mkdocs.__main__ import cli
try:
    cli.commands["serve"].make_context("mkdocs serve", sys.argv[1:])
except click.UsageError as error:
    message = " ".join(error.format_message().split()).rstrip(".")
    print(f"tasks.py: serve: {message} (python3 tasks.py serve --help lists the options)", file=sys.stderr)
    sys.exit(2)
"""


def serve_address(rest: list[str]) -> str:
    """The address `mkdocs serve` will listen on; dies with one line if it is not one, or taken."""
    address = "127.0.0.1:8000"
    for i, arg in enumerate(rest):
        if arg.startswith(("--dev-addr=", "-a=")):
            address = arg.split("=", 1)[1]
        elif arg in {"--dev-addr", "-a"} and i + 1 < len(rest):
            address = rest[i + 1]
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit():
        die(f"--dev-addr {address!r} is not host:port (for example 127.0.0.1:8001)")
    if not 1 <= int(port) <= 65535:
        die(f"--dev-addr {address}: the port must be from 1 to 65535, not {port}")
    taken = port_taken(address)
    if taken == os.strerror(errno.EADDRINUSE):
        die(f"cannot serve on http://{address}/: {taken}. Another server (an earlier "
            f"`tasks.py serve`?) may be running there; stop it, or choose another address: "
            f"python3 tasks.py serve --dev-addr 127.0.0.1:8001")
    if taken:
        die(f"cannot serve on http://{address}/: {taken}")
    return address


def port_taken(address: str) -> str | None:
    """Why `mkdocs serve` could not listen on host:port, or None if it can."""
    host, _, port = address.rpartition(":")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as mkdocs' server does
            probe.bind((host.strip("[]"), int(port)))
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
        print("tasks.py: interrupted", file=sys.stderr)
        sys.exit(130)
