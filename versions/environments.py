"""The version matrix's environments: one per release, with the pinned torch hard-linked from a
torch-only base environment and that release's DeepSpeed installed over it; overlays of other
package versions over a release's environment; the locks that keep two matrix processes from
building at once; and the progress lines the matrix prints.

Environments live outside the clone, in $MATRIX_ENVS (default
~/.cache/shared-params-docs/matrix/<release>/), so a fresh clone on the same machine reuses
them; a missing or outdated one is (re)built. Each has its own TORCH_EXTENSIONS_DIR inside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from rankrun.project import pins
from versions.plan import CONSTRAINTS, packages_prefix, torch_pin

ENVS = Path(os.environ.get("MATRIX_ENVS", Path.home() / ".cache" / "shared-params-docs" / "matrix"))
# Bump when the way an environment is built changes: every environment is rebuilt.
RECIPE = "1: torch linked from a base env; DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==X"
# What ensure_env runs (with the constraints file and the packages the examples need), as the page says it.
INSTALL_COMMAND = "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==X"


def log(message: str) -> None:
    print(f"matrix: {message}", flush=True)


def constraints_without_deepspeed() -> str:
    return "".join(line + "\n" for line in CONSTRAINTS.read_text().splitlines()
                   if not line.startswith("deepspeed=="))


def fingerprint(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in (RECIPE, sys.version.split()[0], *parts):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


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
