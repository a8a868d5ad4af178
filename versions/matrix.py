"""The DeepSpeed version matrix: one environment per release, the version-sensitive examples
run in each with real `torchrun`, the outcomes kept in versions/matrix.json.

    python3 tasks.py matrix                 build what is missing, run everything, write the data
    python3 tasks.py matrix --check         run everything, fail if any release differs from the data
    python3 tasks.py matrix --render        only regenerate snippets/versions/*.md from the data
    python3 tasks.py matrix --release 0.16.4 --release 0.19.8   only these releases
    python3 tasks.py matrix --repeat 5      run every documented command 5 times

Standard library only: tasks.py runs it before anything is installed, and the tests and the
MkDocs hook import it to read the data.

Environments live outside the clone, in $MATRIX_ENVS (default
~/.cache/shared-params-docs/matrix/<release>/), so a fresh clone on the same machine reuses
them; a missing or outdated one is (re)built. Each has its own TORCH_EXTENSIONS_DIR inside it.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import venv
from pathlib import Path

from rankrun.project import PEER_WENT_AWAY, TORCHRUN, free_port, pins, without_addresses

ROOT = Path(__file__).resolve().parent.parent
RELEASES_FILE = ROOT / "versions" / "releases.toml"
DATA_FILE = ROOT / "versions" / "matrix.json"
GENERATED = ROOT / "snippets" / "versions"
CONSTRAINTS = ROOT / "constraints.txt"
ENVS = Path(os.environ.get("MATRIX_ENVS", Path.home() / ".cache" / "shared-params-docs" / "matrix"))
# Bump when the way an environment is built changes: every environment is rebuilt.
RECIPE = "1: torch linked from a base env; DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==X"
# What ensure_env runs (with the constraints file and the packages the examples need), as the page says it.
INSTALL_COMMAND = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==X"
RUN_TIMEOUT = 900.0  # seconds for one torchrun command
PROBE_TIMEOUT = 2400.0  # the first import compiles an op: ~5 min on 2 loaded cores, 10+ when very loaded

# Lines DeepSpeed itself writes to stdout (its logger, its op loader): not the example's output.
# The same filter as the test runner's (rankrun/runner.py, DEEPSPEED_NOISE).
DEEPSPEED_NOISE = re.compile(
    r"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] "
    r"|DeepSpeed \S+ built successfully$)"
)
ABORT_AT_EXIT = "terminate called without an active exception"
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


# --- the list -------------------------------------------------------------------------------

def load_releases() -> dict:
    return tomllib.loads(RELEASES_FILE.read_text())


def release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def releases(config: dict | None = None) -> list[str]:
    config = config or load_releases()
    return sorted(config["releases"], key=release_key)


def example_entries(config: dict | None = None) -> list[tuple[str, list[str] | None]]:
    """(path, releases) for every example: `releases` is None for an example run on every
    release, else the releases it is planned on besides the pinned one (an entry written as
    `{ path = "...", releases = [...] }`)."""
    config = config or load_releases()
    entries, seen = [], set()
    for item in config["examples"]:
        if isinstance(item, dict) and "packages" in item:
            continue  # a run with other package versions: package_entries()
        pattern, only = (item, None) if isinstance(item, str) else (item["path"], list(item["releases"]))
        unknown = [v for v in only or [] if v not in config["releases"]]
        if unknown:
            raise SystemExit(f"versions/releases.toml: {pattern} names releases it does not list: "
                             f"{', '.join(unknown)}")
        for path in sorted(glob.glob(pattern, root_dir=ROOT)):
            if path not in seen:
                seen.add(path)
                entries.append((path, only))
    return entries


def example_files(config: dict | None = None) -> list[str]:
    return [path for path, _ in example_entries(config)]


def planned_releases(command: str, config: dict | None = None) -> list[str]:
    """The releases a command is planned on: every release, or the pinned one and those listed."""
    config = config or load_releases()
    for path, only in example_entries(config):
        if path == example_name(command):
            if only is None:
                return releases(config)
            wanted = set(only) | {config["pinned"]}
            return [v for v in releases(config) if v in wanted]
    raise KeyError(command)


def commands_for(version: str, config: dict | None = None) -> list[str]:
    """The commands planned on one release."""
    config = config or load_releases()
    return [command for command in commands(config) if version in planned_releases(command, config)]


def documented_commands(path: str) -> list[tuple[int, str]]:
    """The (ranks, path) of every torchrun command the file's docstring documents for itself."""
    text = (ROOT / path).read_text()
    found = []
    for ranks, target in TORCHRUN.findall(text):
        if target == path and (int(ranks), path) not in found:
            found.append((int(ranks), path))
    return found


def commands(config: dict | None = None) -> list[str]:
    """The matrix's keys: `torchrun --nproc_per_node N snippets/...py`, one per documented command."""
    return [f"torchrun --nproc_per_node {ranks} {path}"
            for path in example_files(config) for ranks, path in documented_commands(path)]


# --- runs with other package versions -------------------------------------------------------
# An example entry may carry `packages = { peft = "0.8.2" }`: those versions are installed over
# the release's environment (`pip install --no-deps --target`, an overlay folder put first on
# PYTHONPATH), keyed by (release, packages); the release's own environment is left as it is, and
# its Python, torch and compiled op are shared. The results are stored per release under
# "with_packages", keyed by the command with the versions in front:
# `peft==0.8.2 torchrun --nproc_per_node 2 snippets/...py`.

def package_entries(config: dict | None = None) -> list[tuple[str, list[str], dict[str, str]]]:
    """(path, releases, packages) for every entry with `packages`; `releases` defaults to the
    pinned release."""
    config = config or load_releases()
    entries = []
    for item in config["examples"]:
        if not (isinstance(item, dict) and "packages" in item):
            continue
        only = list(item.get("releases", [config["pinned"]]))
        unknown = [v for v in only if v not in config["releases"]]
        if unknown:
            raise SystemExit(f"versions/releases.toml: {item['path']} names releases it does not list: "
                             f"{', '.join(unknown)}")
        packages = {str(name): str(wanted) for name, wanted in sorted(item["packages"].items())}
        for path in sorted(glob.glob(item["path"], root_dir=ROOT)):
            entries.append((path, only, packages))
    return entries


def packages_prefix(packages: dict[str, str]) -> str:
    return " ".join(f"{name}=={wanted}" for name, wanted in sorted(packages.items()))


def package_commands(config: dict | None = None) -> list[str]:
    """`peft==0.8.2 torchrun --nproc_per_node N snippets/...py` for every entry with packages."""
    found = []
    for path, _, packages in package_entries(config):
        for ranks, _ in documented_commands(path):
            key = f"{packages_prefix(packages)} torchrun --nproc_per_node {ranks} {path}"
            if key not in found:
                found.append(key)
    return found


def parse_command(key: str) -> tuple[dict[str, str], int, str]:
    """(packages, ranks, path) of a matrix key, plain or with packages in front."""
    head, _, rest = key.partition("torchrun --nproc_per_node ")
    ranks, path = rest.split(" ", 1)
    packages = dict(part.split("==", 1) for part in head.split())
    return packages, int(ranks), path


def plain_command(key: str) -> str:
    """The key without its packages: the pinned stack's run of the same command."""
    return "torchrun --nproc_per_node " + key.partition("torchrun --nproc_per_node ")[2]


def package_commands_for(version: str, config: dict | None = None) -> list[str]:
    config = config or load_releases()
    planned = {}
    for path, only, packages in package_entries(config):
        if version in only:
            planned.setdefault(packages_prefix(packages), set()).add(path)
    return [key for key in package_commands(config)
            if example_name(key) in planned.get(packages_prefix(parse_command(key)[0]), ())]


def overlay_dir(version: str, packages: dict[str, str]) -> Path:
    slug = "_".join(f"{normalized(name)}-{wanted}" for name, wanted in sorted(packages.items()))
    return ENVS / f"{version}+{slug}"


def ensure_overlay(version: str, packages: dict[str, str], env: Path) -> Path:
    """The packages at these versions in a folder of their own, installed with the release
    environment's pip without dependencies (nothing else is resolved, torch least of all)."""
    overlay = overlay_dir(version, packages)
    stamp = fingerprint("overlay", version, torch_pin(), packages_prefix(packages))
    if (overlay / ".matrix-stamp").is_file() and (overlay / ".matrix-stamp").read_text() == stamp:
        return overlay
    shutil.rmtree(overlay, ignore_errors=True)
    overlay.mkdir(parents=True)
    log(f"installing {packages_prefix(packages)} into {overlay} (over deepspeed {version})")
    overridden = {normalized(name) for name in packages}
    constraints = overlay / "constraints.txt"
    constraints.write_text("".join(f"{name}=={wanted}\n" for name, wanted in pins(CONSTRAINTS).items()
                                   if normalized(name) not in overridden | {"deepspeed"}))
    pip(env / "bin" / "python", "--no-deps", "--target", str(overlay / "site-packages"), "-c",
        str(constraints), *(f"{name}=={wanted}" for name, wanted in sorted(packages.items())),
        logfile=overlay / "build.log")
    (overlay / ".matrix-stamp").write_text(stamp)
    return overlay


def pinned_in_constraints() -> str:
    for line in CONSTRAINTS.read_text().splitlines():
        if line.startswith("deepspeed=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit("constraints.txt pins no deepspeed")


def torch_pin() -> str:
    for line in CONSTRAINTS.read_text().splitlines():
        if line.startswith("torch=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit("constraints.txt pins no torch")


# --- environments ---------------------------------------------------------------------------

def constraints_without_deepspeed() -> str:
    return "".join(line + "\n" for line in CONSTRAINTS.read_text().splitlines()
                   if not line.startswith("deepspeed=="))


def fingerprint(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in (RECIPE, sys.version.split()[0], *parts):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def log(message: str) -> None:
    print(f"matrix: {message}", flush=True)


def pip(python: Path, *args: str, env: dict | None = None, logfile: Path) -> None:
    command = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    with open(logfile, "a") as out:
        out.write("+ " + " ".join(command) + "\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed (exit {done.returncode}); see {logfile}")


def site_packages(env_dir: Path) -> Path:
    return env_dir / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def ensure_base(constraints: Path) -> Path:
    """A torch-only environment, built once; release environments hard-link its files.

    Every release then has byte-identical torch files, and a cold release environment
    costs a DeepSpeed install instead of a torch install too.
    """
    base = ENVS / f"_base-torch-{torch_pin()}"
    stamp = fingerprint("base", torch_pin())
    if ((base / ".matrix-stamp").is_file() and (base / ".matrix-stamp").read_text() == stamp
            and pins_still_hold(base)):
        return base
    shutil.rmtree(base, ignore_errors=True)
    log(f"building the base environment {base} (torch {torch_pin()})")
    venv.create(base, with_pip=True)
    pip(base / "bin" / "python", "-c", str(constraints), f"torch=={torch_pin()}", "setuptools", "pip",
        logfile=base / "build.log")
    (base / ".matrix-stamp").write_text(stamp)
    return base


def link_tree(source: Path, target: Path) -> None:
    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    shutil.copytree(source, target, copy_function=link, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))


def env_dir(version: str) -> Path:
    return ENVS / version


def extensions_dir(env: Path) -> Path:
    """DeepSpeed's JIT-compiled ops for this environment only (never ~/.cache/torch_extensions)."""
    return env / "torch_extensions"


def env_stamp(version: str, config: dict) -> str:
    packages = list(config.get("packages", []))
    return fingerprint("release", version, torch_pin(), *packages)


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions() -> dict[str, str]:
    """constraints.txt as {normalized name: version}."""
    return {normalized(name): wanted for name, wanted in pins(CONSTRAINTS).items()}


def installed_versions(env: Path) -> dict[str, str]:
    """What an environment holds, read from its *.dist-info folder names (no interpreter start)."""
    found = {}
    for info in site_packages(env).glob("*.dist-info"):
        name, _, rest = info.name[: -len(".dist-info")].partition("-")
        found[normalized(name)] = rest.split("+")[0]
    return found


def pins_still_hold(env: Path, skip: set[str] = frozenset()) -> bool:
    """Every distribution in the environment that constraints.txt pins is at that pin.

    Only what the environment holds counts: a pin added or changed for a package the
    environment does not have (say, JupyterLab for the main environment) keeps it current.
    """
    pins = pinned_versions()
    return all(pins[name] == have for name, have in installed_versions(env).items()
               if name in pins and name not in skip)


def env_is_current(version: str, config: dict) -> bool:
    stamp = env_dir(version) / ".matrix-stamp"
    return (stamp.is_file() and stamp.read_text() == env_stamp(version, config)
            and pins_still_hold(env_dir(version), skip={"deepspeed"}))


def ensure_env(version: str, config: dict) -> tuple[Path, bool]:
    """The release's environment, built unless an up-to-date one exists. Returns (dir, built)."""
    env = env_dir(version)
    packages = list(config.get("packages", []))
    constraints_text = constraints_without_deepspeed()
    stamp = env_stamp(version, config)
    if env_is_current(version, config):
        return env, False
    ENVS.mkdir(parents=True, exist_ok=True)
    constraints = ENVS / "constraints-without-deepspeed.txt"
    constraints.write_text(constraints_text)
    base = ensure_base(constraints)
    shutil.rmtree(env, ignore_errors=True)
    log(f"building {env} (deepspeed {version})")
    venv.create(env, with_pip=False)
    link_tree(site_packages(base), site_packages(env))
    python = env / "bin" / "python"
    # torchrun, as pip would write it, for this environment's interpreter.
    torchrun = env / "bin" / "torchrun"
    torchrun.write_text(f"#!{python}\nimport sys\nfrom torch.distributed.run import main\n"
                        "if __name__ == '__main__':\n    sys.exit(main())\n")
    torchrun.chmod(0o755)
    build_env = {**os.environ, "DS_BUILD_OPS": "0"}
    logfile = env / "build.log"
    pip(python, "-c", str(constraints), "--no-build-isolation", f"deepspeed=={version}", *packages,
        env=build_env, logfile=logfile)
    (env / ".matrix-stamp").write_text(stamp)
    return env, True


# --- runs -----------------------------------------------------------------------------------

def run_environment(env: Path, extra: dict[str, str]) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "LOCAL_SIZE"}}
    environment.update({
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(extensions_dir(env)),
        "PATH": f"{env / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        **extra,
    })
    return environment


def last_exception(stderr: str) -> str | None:
    """The `Type: message` line of the last traceback in a rank's stderr, if it has one."""
    lines = [RANK_PREFIX.sub("", line) for line in stderr.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1:]:
        if line and not line[0].isspace():
            return without_addresses(TERMINAL_STYLE.sub("", line.rstrip()))
    return None


# Terminal colour and bold codes inside a message (torch's weights-only error has them): not text.
TERMINAL_STYLE = re.compile(r"\x1b\[[0-9;]*m")


# What older releases also print to stdout themselves: their op loader and torch's extension
# builder, and their configuration, logged as JSON over many lines (only the first line has the
# logger's prefix). Lines of such a dump are recognised on their own, so that filtering twice
# changes nothing (the data file keeps filtered output; a wider filter applies to it later).
OLDER_NOISE = re.compile(
    r"^(ninja: no work to do\.$|Time to load \S+ op: [\d.e+-]+ seconds$"
    r"|Parameter Offload: Total persistent parameters: \d+ in \d+ params$"
    r"|Parameter Offload - Persistent parameters statistics: param_count = \d+, numel = \d+$"
    r"|Using \S+ as PyTorch extensions root\.\.\.$|Emitting ninja build file |Building extension module "
    r"|Loading extension module |Allowing ninja to set a default number of workers"
    r'|\s*"[^"]+": .*$|\s*[{}\]],?\s*$)'
)


def printed(stdout: str) -> str:
    """What the example printed itself: stdout without the lines DeepSpeed and torch write."""
    return "".join(line + "\n" for line in stdout.splitlines()
                   if not DEEPSPEED_NOISE.match(line) and not OLDER_NOISE.match(line))


def run_command(python: Path, env: Path, ranks: int, path: str, extra: dict[str, str]) -> dict:
    """One documented command with real torchrun: what each rank printed, raised and exited with."""
    with tempfile.TemporaryDirectory(prefix="matrix-run-") as logs:
        command = [str(python), "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   "--master_port", str(free_port()), "--log-dir", logs, "--redirects", "3",
                   "--tee", "0", path]
        started = time.monotonic()
        process = subprocess.Popen(command, cwd=ROOT, env=run_environment(env, extra),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        try:
            agent_out, agent_err = process.communicate(timeout=RUN_TIMEOUT)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            agent_out, agent_err = process.communicate()
            timed_out = True
        seconds = time.monotonic() - started
        outcome = {"ranks": [], "exit": process.returncode, "timed_out": timed_out}
        for rank in range(ranks):
            found = glob.glob(os.path.join(logs, "*", "attempt_0", str(rank)))
            stdout = stderr = ""
            if found:
                stdout = Path(found[0], "stdout.log").read_text(errors="replace")
                stderr = Path(found[0], "stderr.log").read_text(errors="replace")
            outcome["ranks"].append({
                "printed": printed(stdout),
                "raised": last_exception(stderr),
                "aborted_at_exit": ABORT_AT_EXIT in stderr,
            })
    outcome["seconds"] = round(seconds, 1)
    return outcome


def probe(python: Path, env: Path, extra: dict[str, str]) -> dict:
    """Import DeepSpeed and start a one-rank gloo group (this compiles DeepSpeed's CPU
    communication op into the environment's TORCH_EXTENSIONS_DIR once)."""
    code = ("import deepspeed, torch\n"
            "deepspeed.init_distributed(dist_backend='gloo')\n"
            "torch.distributed.barrier()\n"
            "print(deepspeed.__version__, torch.__version__)\n")
    environment = run_environment(env, {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                        "MASTER_PORT": str(free_port()), **extra})
    # A compile that was interrupted (a killed run) leaves torch's lock file behind, and the next
    # load would wait for it forever. Only this process builds in this environment (.build.lock).
    for stale in extensions_dir(env).glob("*/lock"):
        stale.unlink()
    started = time.monotonic()
    process = subprocess.Popen([str(python), "-c", code], cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the compiler too, not only the interpreter
        process.communicate()
        raise
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    result = {"ok": done.returncode == 0, "seconds": round(time.monotonic() - started, 1)}
    if done.returncode == 0:
        result["versions"] = done.stdout.split()[-2:]
    else:
        result["raised"] = last_exception(done.stderr) or (done.stderr.strip().splitlines() or ["?"])[-1]
    return result


def compared(outcome: dict) -> dict:
    """The part of a run that must be the same every time: what each rank printed, the
    exceptions raised (by any rank: when one rank fails, torchrun stops the others, so which
    rank gets to raise first varies), and whether the command succeeded. An abort at exit is a
    failed command like any other (the examples end so that none can happen); the runs where
    one happened are also counted apart."""
    raised = sorted({rank["raised"] for rank in outcome["ranks"] if rank["raised"]})
    raised = [error for error in raised if not PEER_WENT_AWAY.search(error)] or raised
    return {"printed": [rank["printed"] for rank in outcome["ranks"]], "raised": raised,
            "ok": outcome["exit"] == 0, "timed_out": outcome["timed_out"]}


@contextlib.contextmanager
def locked(name: str):
    """An exclusive lock on ENVS/name, held by one `tasks.py matrix` process at a time."""
    ENVS.mkdir(parents=True, exist_ok=True)
    with open(ENVS / name, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_release(version: str, config: dict, repeat: int, only: list[str] | None = None) -> dict:
    spec = config["releases"][version]
    extra = {key: str(value) for key, value in spec.get("env", {}).items()}
    # Building (pip, and the op DeepSpeed compiles on its first run, which the probe triggers)
    # is the heavy part: two matrix processes never build at the same time. A warm environment
    # (up to date, its op compiled) needs no lock.
    warm = env_is_current(version, config) and any(extensions_dir(env_dir(version)).glob("*/*.so"))
    with (contextlib.nullcontext() if warm else locked(".build.lock")):
        started = time.monotonic()
        env, built = ensure_env(version, config)
        build_seconds = round(time.monotonic() - started, 1)
        python = env / "bin" / "python"
        log(f"{version}: environment {'built' if built else 'reused'} ({build_seconds} s); "
            f"importing deepspeed and starting a one-rank group")
        # The probe's result is kept with the environment: a warm run (same environment,
        # same variables) reuses it; the examples import DeepSpeed again anyway.
        cached = env / ".matrix-probe.json"
        key = (env / ".matrix-stamp").read_text() + json.dumps(extra, sort_keys=True)
        kept = json.loads(cached.read_text()) if cached.is_file() else {}
        if kept.get("key") == key:
            row = {"env": extra, "probe": {**kept["probe"], "seconds": 0.0}}
        else:
            row = {"env": extra, "probe": probe(python, env, extra)}
            cached.write_text(json.dumps({"key": key, "probe": {k: v for k, v in row["probe"].items()
                                                                 if k != "seconds"}}))
    log(f"{version}: import {'ok' if row['probe']['ok'] else 'failed'} ({row['probe']['seconds']} s)")
    timings = {"built": built, "build_seconds": build_seconds, "probe_seconds": row["probe"].pop("seconds")}
    if not row["probe"]["ok"]:
        log(f"{version}: cannot run: {row['probe']['raised']}")
        return {"row": row, "timings": timings}
    row["probe"].pop("versions", None)
    row["examples"] = {}
    for key in commands_for(version, config):
        if only and not any(part in key for part in only):
            continue
        _, _, ranks, path = key.split(" ", 3)
        runs = [run_command(python, env, int(ranks), path, extra) for _ in range(repeat)]
        first = compared(runs[0])
        row["examples"][key] = {
            **first,
            "runs": repeat,
            "same_every_run": all(compared(run) == first for run in runs),
            "aborted_at_exit": sum(any(rank["aborted_at_exit"] for rank in run["ranks"]) for run in runs),
        }
        timings.setdefault("runs", {})[key] = [run["seconds"] for run in runs]
        log(f"{version}: {key}: {describe_run(row['examples'][key])} "
            f"({', '.join(str(run['seconds']) for run in runs)} s)")
    for key in package_commands_for(version, config):
        if only and not any(part in key for part in only):
            continue
        packages, ranks, path = parse_command(key)
        overlay = ensure_overlay(version, packages, env)
        with_overlay = {**extra, "PYTHONPATH": str(overlay / "site-packages")}
        runs = [run_command(python, env, ranks, path, with_overlay) for _ in range(repeat)]
        first = compared(runs[0])
        row.setdefault("with_packages", {})[key] = {
            **first,
            "runs": repeat,
            "same_every_run": all(compared(run) == first for run in runs),
            "aborted_at_exit": sum(any(rank["aborted_at_exit"] for rank in run["ranks"]) for run in runs),
        }
        timings.setdefault("runs", {})[key] = [run["seconds"] for run in runs]
        log(f"{version}: {key}: {describe_run(row['with_packages'][key])} "
            f"({', '.join(str(run['seconds']) for run in runs)} s)")
    if extra and config.get("env_check"):
        path = config["env_check"]["example"]
        for ranks, _ in documented_commands(path)[:1]:
            outcome = compared(run_command(python, env, ranks, path, {}))
            row["without_env"] = {"command": f"torchrun --nproc_per_node {ranks} {path}",
                                  "raised": outcome["raised"], "ok": outcome["ok"]}
    return {"row": row, "timings": timings}


def describe_run(entry: dict) -> str:
    text = "raised " + "; ".join(entry["raised"]) if entry["raised"] else ("ok" if entry["ok"] else "failed")
    if entry["aborted_at_exit"]:
        text += f"; aborted at exit in {entry['aborted_at_exit']} of {entry['runs']} runs"
    return text


# --- the data and what pages show -----------------------------------------------------------

def load_data() -> dict:
    if not DATA_FILE.is_file():
        return {"releases": {}}
    return json.loads(DATA_FILE.read_text())


def save_data(data: dict) -> None:
    DATA_FILE.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")


def transcript(entry: dict) -> list[str]:
    """What a reader sees from a run, rank 0 first: printed lines, then the exception of any rank."""
    lines = []
    for text in entry["printed"]:
        lines += printed(text).splitlines()
    return lines + entry["raised"]


def differences(entry: dict, pinned: dict) -> list[tuple[str, str, str]]:
    """(context, line on this release, line on the pinned release) for every changed line.

    The context is the nearest unindented line above the change (a pattern's name in the
    automatic-detection table, `step 0: loss ...` in ModuleZ3)."""
    mine, theirs = transcript(entry), transcript(pinned)
    found = []
    matcher = difflib.SequenceMatcher(a=mine, b=theirs, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        context = ""
        for line in reversed(theirs[:b0]):
            if line and not line[0].isspace():
                context = line
                break
        here, there = mine[a0:a1], theirs[b0:b1]
        for i in range(max(len(here), len(there))):
            found.append((context, here[i].strip() if i < len(here) else "(no line)",
                          there[i].strip() if i < len(there) else "(no line)"))
    return found


def summary(data: dict | None = None, config: dict | None = None) -> dict:
    """Per example and changed line: the releases that differ from the pinned one."""
    data = data or load_data()
    config = config or load_releases()
    pinned = config["pinned"]
    pinned_row = data["releases"].get(pinned, {}).get("examples", {})
    changes = {}  # (command, context, pinned line) -> {release: line there}
    for version in releases(config):
        row = data["releases"].get(version)
        if not row or not row.get("probe", {}).get("ok"):
            continue
        for key, entry in row.get("examples", {}).items():
            if key not in pinned_row:
                continue
            for context, here, there in differences(entry, pinned_row[key]):
                changes.setdefault((key, context, there), {})[version] = here
    return changes


def ran_releases(data: dict, command: str) -> list[str]:
    return sorted((version for version, row in data["releases"].items()
                   if command in row.get("examples", {})), key=release_key)


def span(versions: list[str], all_versions: list[str]) -> str:
    """`0.14.5 to 0.16.4` for a run of consecutive releases of the list, else a comma list."""
    if len(versions) == 1:
        return versions[0]
    indices = [all_versions.index(v) for v in versions]
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{versions[0]} to {versions[-1]}"
    return ", ".join(versions)


def example_name(command: str) -> str:
    return command.rsplit(" ", 1)[1]


def upstream_for(config: dict, command: str, release: str | None) -> dict | None:
    for item in config.get("upstream", []):
        if item["release"] == release and item["example"] == example_name(command):
            return item
    return None


def render_versions_page(data: dict, config: dict) -> str:
    """The generated part of docs/versions.md."""
    all_versions = releases(config)
    pinned = config["pinned"]
    out = []
    out.append(f"Every release was installed with `{INSTALL_COMMAND}` beside torch {data.get('torch')} "
               f"(Python {data.get('python')}).")
    out.append("")
    out.append("| Release | Runs the examples? | Needs | Exit abort seen |")
    out.append("|---|---|---|---|")
    for version in all_versions:
        row = data["releases"].get(version)
        if row is None:
            out.append(f"| {version} | not run yet | | |")
            continue
        if not row["probe"]["ok"]:
            out.append(f"| {version} | no: `{row['probe']['raised']}` at `import deepspeed` | | |")
            continue
        needs = ", ".join(f"`{k}={v}`" for k, v in row["env"].items())
        if row.get("without_env"):
            needs += " (without it: `" + "; ".join(row["without_env"]["raised"]) + "`)"
        aborts = [f"{entry['aborted_at_exit']} of {entry['runs']} runs of `{example_name(key)}`"
                  for key, entry in row["examples"].items() if entry["aborted_at_exit"]]
        runs = sum(entry["runs"] for entry in row["examples"].values())
        marker = " (pinned)" if version == pinned else ""
        out.append(f"| {version}{marker} | yes | {needs or 'nothing'} | "
                   f"{'; '.join(aborts) or f'no (in {runs} runs)'} |")
    out.append("")
    running = [v for v in all_versions if data["releases"].get(v, {}).get("probe", {}).get("ok")]
    partial: dict[tuple[str, ...], list[str]] = {}
    for command in commands(config):
        ran = ran_releases(data, command)
        if ran != running:
            names = partial.setdefault(tuple(ran), [])
            if example_name(command) not in names:
                names.append(example_name(command))
    for ran, names in partial.items():
        where = " and ".join(ran) if len(ran) <= 2 else ", ".join(ran)
        out.append(f"Run on {where} only (not run on the other releases): "
                   f"{', '.join(code(name.rsplit('/', 1)[1]) for name in names)}.")
        out.append("")
    with_packages: dict[str, list[str]] = {}
    for version in all_versions:
        for key in data["releases"].get(version, {}).get("with_packages", {}):
            packages = ", ".join(f"{name} {wanted}" for name, wanted in parse_command(key)[0].items())
            with_packages.setdefault(example_name(key), []).append(f"{version} with {packages}")
    for path, runs in with_packages.items():
        out.append(f"Run with other package versions, installed over the release's environment: "
                   f"{code(path.rsplit('/', 1)[1])} on {'; '.join(runs)} (what differs is in its note).")
        out.append("")
    by_command = grouped(data, config)
    if not any(groups for groups in by_command.values()):
        out.append(f"Every release that runs prints the same as {pinned} in every example of the matrix.")
        return "\n".join(out) + "\n"
    out.append(f"What differs from {pinned}: one line per change, with the releases it holds for "
               f"(and when it changed, where both sides ran), the example, and what its run printed "
               f"or raised there. An example not listed printed the same on every release it ran on; "
               f"so did every line not listed.")
    out.append("")
    for command, groups in by_command.items():
        if not groups:
            continue
        for change in changes_of(data, config, command):
            out.append(f"- {change_line(change, example_name(command))}")
            if change["upstream"]:
                out.append(f"    {linked(change['upstream']['what'])}")
    return "\n".join(out).rstrip() + "\n"


def grouped(data: dict, config: dict) -> dict[str, list[tuple[list[str], dict]]]:
    """Per command: the releases whose transcript differs from the pinned one, grouped by transcript."""
    pinned = config["pinned"]
    result = {}
    for command in commands(config):
        pinned_entry = data["releases"].get(pinned, {}).get("examples", {}).get(command)
        groups: dict[tuple, tuple[list[str], dict]] = {}
        for version in ran_releases(data, command):
            entry = data["releases"][version]["examples"][command]
            key = tuple(transcript(entry))
            if pinned_entry is None or key == tuple(transcript(pinned_entry)):
                continue
            groups.setdefault(key, ([], entry))[0].append(version)
        result[command] = list(groups.values())
    return result


def release_after(versions: list[str], ran: list[str]) -> str | None:
    """The release (of those run) right after `versions`, if they are a consecutive run of them."""
    indices = [ran.index(v) for v in versions]
    if indices != list(range(indices[0], indices[-1] + 1)) or indices[-1] + 1 >= len(ran):
        return None
    return ran[indices[-1] + 1]


def when_changed(last_different: str, first_same: str) -> str:
    """`changed in 0.16.5` when the two releases are consecutive, else `changed between A and B`."""
    a, b = release_key(last_different), release_key(first_same)
    if a[:-1] == b[:-1] and b[-1] == a[-1] + 1:
        return f"changed in {first_same}"
    return f"changed between {last_different} and {first_same}"


# --- Markdown for the pages: every message in code, every other character escaped -----------

def code(text: str) -> str:
    """`text` as one inline code span whatever it holds (backticks, `<rank>`, `|`, `*`):
    the fence is one backtick longer than the longest run inside, padded when needed.
    Runs of spaces are shown as one (the browser would collapse them anyway)."""
    text = " ".join(text.split())
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if longest or text.startswith("\\") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def plain(text: str) -> str:
    """`text` as literal text in Markdown: no emphasis, code, link, table cell or HTML tag."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", text)


UPSTREAM_REF = re.compile(r"(?<![\w/])((?:[\w.-]+/[\w.-]+)?)#(\d+)\b")
UPSTREAM_REPO = "deepspeedai/DeepSpeed"


def linked(markdown: str) -> str:
    """Hand-written Markdown with its upstream references (`deepspeedai/DeepSpeed#7018`, and a
    bare `#7104` after one) made links to GitHub; code spans are left alone."""
    parts = re.split(r"(`+[^`]*`+)", markdown)
    repo = UPSTREAM_REPO

    def link(match):
        nonlocal repo
        repo = match.group(1) or repo
        return f"[{match.group(0)}](https://github.com/{repo}/issues/{match.group(2)})"

    return "".join(part if part.startswith("`") else UPSTREAM_REF.sub(link, part) for part in parts)


TABLE_ROW = re.compile(r"^\|.*\|$")
FOOTNOTE = re.compile(r"^- \(([a-z])\) `(.*)`$")


def cells(row: str) -> list[str]:
    """The cells of a Markdown table row, `|` inside code spans kept."""
    found, current, in_code = [], "", False
    for char in row.strip()[1:-1]:
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            found.append(current.strip())
            current = ""
        else:
            current += char
    return found + [current.strip()]


def shortened(line: str, width: int = 72) -> str:
    """A printed line cut at a word to about `width` characters (the line a run did not reach)."""
    line = " ".join(line.split())
    return line if len(line) <= width else line[:width].rsplit(" ", 1)[0] + " ..."


def cell_markdown(cell: str, footnotes: dict[str, str]) -> str:
    """A table cell of an example's output for a sentence: its code spans kept as code, its
    emphasis dropped, a footnote mark `(d)` replaced by the error it stands for."""
    out = []
    for part in re.split(r"(`[^`]+`)", cell):
        if len(part) > 1 and part.startswith("`") and part.endswith("`"):
            out.append(code(part[1:-1]))
            continue
        for piece in re.split(r"(\([a-z]\))", part.replace("**", "").replace("*", "")):
            mark = re.fullmatch(r"\(([a-z])\)", piece)
            if mark and mark.group(1) in footnotes:
                out.append("with " + code(footnotes[mark.group(1)]))
            else:
                out.append(plain(piece))
    return "".join(out).strip()


def table_header(lines: list[str], index: int) -> list[str] | None:
    """The header cells of the table that holds lines[index], if it is a table row."""
    if not TABLE_ROW.match(lines[index]):
        return None
    start = index
    while start > 0 and TABLE_ROW.match(lines[start - 1]):
        start -= 1
    if start + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[start + 1].strip()):
        return cells(lines[start])
    return None


def footnotes_of(lines: list[str]) -> dict[str, str]:
    return {match.group(1): match.group(2) for match in map(FOOTNOTE.match, lines) if match}


def row_change(here: str, there: str, header: list[str], mine: dict, theirs: dict, pinned: str) -> str | None:
    """`row R, column C: V (pinned: W)` for a table row whose cells changed, or None when the
    two lines are not the same row of the same table."""
    a, b = cells(here), cells(there)
    if len(a) != len(b) or len(a) != len(header) or a[0] != b[0]:
        return None
    changed = [i for i in range(len(a)) if a[i] != b[i]]
    label = ", ".join(cell_markdown(cell, theirs) for cell in b[:max(1, changed[0])])
    return f"row {label}: " + "; ".join(
        f"column \u201c{cell_markdown(header[i], theirs)}\u201d: {cell_markdown(a[i], mine)} "
        f"({pinned}: {cell_markdown(b[i], theirs)})" for i in changed)


def changed_lines(entry: dict, pinned_entry: dict) -> list[tuple[str, str, str, int | None]]:
    """(context, line here, line on the pinned release, index of that line in the pinned
    transcript or None) for every printed line that changed."""
    mine, theirs = transcript({**entry, "raised": []}), transcript({**pinned_entry, "raised": []})
    found = []
    matcher = difflib.SequenceMatcher(a=mine, b=theirs, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        context = next((line for line in reversed(theirs[:b0]) if line and not line[0].isspace()), "")
        for i in range(max(a1 - a0, b1 - b0)):
            found.append((context, mine[a0 + i].strip() if a0 + i < a1 else "(no line)",
                          theirs[b0 + i].strip() if b0 + i < b1 else "(no line)",
                          b0 + i if b0 + i < b1 else None))
    return found


def describe_difference(entry: dict, pinned_entry: dict, pinned: str) -> list[str]:
    """What a release's run does differently from the pinned one: one Markdown sentence per
    change, every message and printed line in code."""
    new_raised = [r for r in entry["raised"] if r not in pinned_entry["raised"]]
    per_rank = [(printed(a).splitlines(), printed(b).splitlines())
                for a, b in zip(entry["printed"], pinned_entry["printed"])]
    if new_raised and all(mine == theirs[:len(mine)] for mine, theirs in per_rank):
        # Stopped early, with the same output up to there: say where (rank 0's view).
        mine, theirs = per_rank[0]
        where = f"after printing {code(mine[-1])}" if mine else "before printing anything"
        instead = (f" ({pinned} prints {code(shortened(theirs[len(mine)]))} next)"
                   if len(mine) < len(theirs) else "")
        return [f"stops {where} with {code(raised)}{instead}" for raised in new_raised]
    theirs_lines = transcript({**pinned_entry, "raised": []})
    mine_notes, their_notes = footnotes_of(transcript(entry)), footnotes_of(theirs_lines)
    rows, printed_lines = [], {}  # printed_lines: what changed -> the contexts it changed under
    for context, here, there, index in changed_lines(entry, pinned_entry):
        header = table_header(theirs_lines, index) if index is not None else None
        sentence = row_change(here, there, header, mine_notes, their_notes, pinned) if header else None
        if sentence is not None:
            rows.append(sentence)
        else:
            where = printed_lines.setdefault(f"{code(here)} ({pinned}: {code(there)})", [])
            if context and context != there:
                where.append(context)
    lines = list(rows)
    by_contexts: dict[tuple, list[str]] = {}
    for what, contexts in printed_lines.items():
        by_contexts.setdefault(tuple(contexts), []).append(what)
    for contexts, whats in by_contexts.items():
        under = f"under {', '.join(code(c) for c in contexts)} " if contexts else ""
        lines.append(f"{under}prints {', '.join(whats)}")
    lines += [f"raises {code(raised)}" for raised in new_raised]
    lines += [f"does not raise {code(raised)} ({pinned} does)"
              for raised in pinned_entry["raised"] if raised not in entry["raised"]]
    if entry["ok"] != pinned_entry["ok"] and not new_raised:
        lines.append("the command " + ("succeeds" if entry["ok"] else "fails") + f" ({pinned}: the opposite)")
    return lines


def changes_of(data: dict, config: dict, command: str) -> list[dict]:
    """One entry per group of releases that differ from the pinned one in `command`: the
    releases as a span, when it changed, the sentences, the curated upstream change."""
    pinned = config["pinned"]
    ran = ran_releases(data, command)
    found = []
    for versions, entry in grouped(data, config)[command]:
        # The release after this run of releases prints something else: the pinned
        # release's output, or another group's.
        following = release_after(versions, ran)
        when = when_changed(versions[-1], following) if following else None
        exact = bool(when and when.startswith("changed in"))
        found.append({
            "span": span(versions, ran), "when": when,
            "sentences": describe_difference(entry, data["releases"][pinned]["examples"][command], pinned),
            "upstream": upstream_for(config, command, following) if exact else None,
        })
    return found


def change_line(change: dict, example: str | None = None) -> str:
    """One compact line per change: the releases (when it changed), the example, what differs."""
    when = f" ({change['when']})" if change["when"] else ""
    named = f", {code(Path(example).name)}" if example else ""
    line = f"**{change['span']}**{when}{named}: {'; '.join(change['sentences'])}."
    if change["upstream"]:
        line += f" Upstream: {linked(change['upstream']['change'])}."
    return line


def render_example_note(data: dict, config: dict, path: str) -> str:
    """A note for the pages that show `path`: the releases it ran on, and where its output differs."""
    pinned = config["pinned"]
    lines = []
    others = set()
    for command in commands(config):
        if example_name(command) != path:
            continue
        others.update(v for v in ran_releases(data, command) if v != pinned)
        for change in changes_of(data, config, command):
            lines.append(change_line(change))
    lines += package_lines(data, config, path)
    head = (f'!!! note "Other DeepSpeed releases"\n    This example also ran on DeepSpeed '
            f"{', '.join(sorted(others, key=release_key)) or '(none yet)'} "
            f"([DeepSpeed versions](../versions.md)).")
    if package_runs(data, path):
        head += " It also ran with other versions of the packages named in bold (installed over the release's environment)."
    if not lines:
        return head + f" Every release printed the same as {pinned}.\n"
    return head + f" What differs from {pinned}:\n\n" + "".join(f"    - {line}\n" for line in lines)


def package_runs(data: dict, path: str) -> list[tuple[str, str, dict]]:
    """(release, key, entry) of every run of `path` with other package versions."""
    return [(version, key, entry)
            for version in sorted(data["releases"], key=release_key)
            for key, entry in data["releases"][version].get("with_packages", {}).items()
            if example_name(key) == path]


def package_lines(data: dict, config: dict, path: str) -> list[str]:
    """One line per run with other package versions: what differs from the pinned stack."""
    pinned = config["pinned"]
    lines = []
    for version, key, entry in package_runs(data, path):
        packages = parse_command(key)[0]
        label = f"**{version} with {', '.join(f'{name} {wanted}' for name, wanted in packages.items())}**"
        base = data["releases"].get(pinned, {}).get("examples", {}).get(plain_command(key))
        if base is None:
            continue
        if transcript(entry) == transcript(base):
            lines.append(f"{label}: printed the same as {pinned} with the pinned packages.")
            continue
        lines.append(f"{label}: {'; '.join(describe_difference(entry, base, pinned))}.")
    return lines


def note_name(path: str) -> str:
    """The generated note of an example: snippets/versions/<its name>.md."""
    return Path(path).stem + ".md"


def examples_with_differences(data: dict, config: dict) -> list[str]:
    """The examples (paths) whose output on some release differs from the pinned release's:
    each gets a note, which every page showing the example includes."""
    differing = {example_name(command) for command, groups in grouped(data, config).items() if groups}
    return sorted(differing | {example_name(key) for row in data["releases"].values()
                               for key in row.get("with_packages", {})})


def render(data: dict | None = None, config: dict | None = None) -> dict[str, str]:
    """Every generated file: versions.md, and a note per example with differences."""
    data = data or load_data()
    config = config or load_releases()
    files = {"versions.md": render_versions_page(data, config)}
    for path in examples_with_differences(data, config):
        files[note_name(path)] = render_example_note(data, config, path)
    return files


def write_generated(data: dict | None = None) -> None:
    GENERATED.mkdir(exist_ok=True)
    files = render(data)
    for name, text in files.items():
        (GENERATED / name).write_text(text)
    for stale in GENERATED.glob("*.md"):
        if stale.name not in files:
            stale.unlink()


def pinned_row_now(config: dict | None = None, python: Path | None = None) -> dict:
    """The pinned release's examples run now in the project's own environment."""
    config = config or load_releases()
    python = python or Path(sys.executable)
    env = python.parent.parent
    examples = {}
    for key in commands(config):
        _, _, ranks, path = key.split(" ", 3)
        outcome = run_command(python, env, int(ranks), path, {})
        examples[key] = compared(outcome)
    return examples


# --- the command ----------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tasks.py matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with versions/matrix.json instead of writing it; exit 1 on a difference")
    parser.add_argument("--render", action="store_true", help="only regenerate snippets/versions/*.md")
    parser.add_argument("--release", action="append", help="only this release (repeatable)")
    parser.add_argument("--example", action="append", help="only commands containing this text (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every documented command (default 1)")
    parser.add_argument("--timings", type=Path, help="write build and run times (JSON) here")
    args = parser.parse_args(argv)
    config = load_releases()
    if config["pinned"] != pinned_in_constraints():
        raise SystemExit(f"versions/releases.toml pins {config['pinned']}, constraints.txt {pinned_in_constraints()}")
    if args.render:
        write_generated()
        return 0
    chosen = args.release or releases(config)
    unknown = [v for v in chosen if v not in config["releases"]]
    if unknown:
        raise SystemExit(f"not in versions/releases.toml: {', '.join(unknown)}")
    data = load_data()
    data["torch"] = torch_pin()
    data["python"] = sys.version.split()[0]
    data["pinned"] = config["pinned"]
    started = time.monotonic()
    timings = {}
    failures = []
    for version in chosen:
        log(f"--- deepspeed {version}")
        result = run_release(version, config, args.repeat, args.example)
        timings[version] = result["timings"]
        new = result["row"]
        old = data["releases"].get(version)
        if args.check:
            problems = compare_rows(old, new, partial=bool(args.example))
            failures += [f"{version}: {problem}" for problem in problems]
        else:
            # After every release (an interrupted run keeps what it measured), re-reading the
            # file: another matrix process may have written other releases meanwhile.
            with locked(".data.lock"):
                data = {**load_data(), "torch": data["torch"], "python": data["python"], "pinned": data["pinned"]}
                old = data["releases"].get(version)
                if args.example and old and "examples" in old and "examples" in new:
                    new["examples"] = {**old["examples"], **new["examples"]}
                if args.example and old and (old.get("with_packages") or new.get("with_packages")):
                    new["with_packages"] = {**old.get("with_packages", {}), **new.get("with_packages", {})}
                data["releases"][version] = new
                data["releases"] = dict(sorted(data["releases"].items(), key=lambda item: release_key(item[0])))
                save_data(data)
        log(f"{version}: {round(time.monotonic() - started)} s so far")
    timings["total_seconds"] = round(time.monotonic() - started, 1)
    log(f"matrix: {timings['total_seconds']} s for {len(chosen)} releases")
    if args.timings:
        args.timings.write_text(json.dumps(timings, indent=1) + "\n")
    if args.check:
        for failure in failures:
            print(f"matrix: DIFFERS {failure}", file=sys.stderr)
        return 1 if failures else 0
    with locked(".data.lock"):
        write_generated(load_data())
    return 0


def comparable(entry: dict) -> dict:
    return {"printed": [printed(text) for text in entry["printed"]], "raised": entry["raised"],
            "ok": entry["ok"], "timed_out": entry["timed_out"]}


def compare_rows(old: dict | None, new: dict, partial: bool = False) -> list[str]:
    """What differs between the committed row of a release and a fresh one (timings are not
    compared; a run that aborted at exit failed, so it differs in `ok`)."""
    if old is None:
        return ["not in versions/matrix.json"]
    problems = []
    if old["probe"] != new["probe"]:
        problems.append(f"import: committed {old['probe']}, now {new['probe']}")
    for key, entry in new.get("examples", {}).items():
        committed = old.get("examples", {}).get(key)
        if committed is None:
            problems.append(f"{key}: not in versions/matrix.json")
            continue
        if comparable(committed) != comparable(entry):
            diff = "\n".join(difflib.unified_diff(transcript(committed), transcript(entry), "committed", "now",
                                                  lineterm=""))
            problems.append(f"{key}: differs\n{diff}")
        if entry["aborted_at_exit"]:
            print(f"matrix: note: {key} aborted at exit in {entry['aborted_at_exit']} of {entry['runs']} runs",
                  file=sys.stderr)
    for key, entry in new.get("with_packages", {}).items():
        committed = old.get("with_packages", {}).get(key)
        if committed is None:
            problems.append(f"{key}: not in versions/matrix.json")
        elif comparable(committed) != comparable(entry):
            diff = "\n".join(difflib.unified_diff(transcript(committed), transcript(entry), "committed", "now",
                                                  lineterm=""))
            problems.append(f"{key}: differs\n{diff}")
    for key in old.get("examples", {}):
        if key not in new.get("examples", {}) and not partial:
            problems.append(f"{key}: in versions/matrix.json but not run")
    return problems


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
