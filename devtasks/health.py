"""The check, before every command but `matrix`, that `.venv` still holds what the install put there.

A package uninstalled, changed or deleted by hand in `.venv`, or the project installed from another
checkout, is noticed and repaired by the install (devtasks.install), not found later as a crash:
without the project's own install pytest runs without the harness's plugin. The check runs inside
`.venv`'s python (CHECK_ENVIRONMENT), about 0.2 s, so every command can afford it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib

from devtasks.checkout import CONSTRAINTS, PYTHON, ROOT

# Run by the environment's own python (isolated: -I, so the checkout itself is not on
# sys.path): which pinned distributions are missing, at another version, or installed with
# their files gone (a top-level module of theirs cannot be found), and whether the project
# itself is installed from this checkout with the entry points pyproject.toml declares.
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
