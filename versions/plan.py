"""What the version matrix runs: the releases versions/releases.toml lists, the examples and
their documented `torchrun` commands, which commands are planned on which release (plain, or
with other package versions installed over the release's environment, keyed as
`peft==0.8.2 torchrun ...`), and the pins in constraints.txt."""

from __future__ import annotations

import glob
import tomllib
from pathlib import Path

from rankrun.project import TORCHRUN

ROOT = Path(__file__).resolve().parent.parent
RELEASES_FILE = ROOT / "versions" / "releases.toml"
CONSTRAINTS = ROOT / "constraints.txt"


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


def example_name(command: str) -> str:
    return command.rsplit(" ", 1)[1]


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
