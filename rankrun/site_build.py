"""The session's strict build of the real project, shared by the tests that read the site.

`mkdocs build --strict` of the project runs once per test session (it executes the notebook,
which starts a real 2-rank run): tests/conftest.py starts it in the background when collection
ends (`start_strict_build`), and every test that reads the site waits for the same record
(`strict_build`) under a file lock in SITE_BUILD_DIR.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rankrun.project import ROOT


def build(project_dir, site_dir, **env):
    """`mkdocs build --strict`; a variable given as None is removed from the environment."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", **env}
    env = {name: value for name, value in env.items() if value is not None}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=project_dir, env=env, capture_output=True, text=True, timeout=900,
    )


def build_base() -> Path:
    """Where the session's strict build goes: SITE_BUILD_DIR (tests/conftest.py), shared by its workers."""
    shared = os.environ.get("SITE_BUILD_DIR")
    if shared:
        return Path(shared)
    base = Path(tempfile.mkdtemp(prefix="site-"))  # imported outside a test session
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    os.environ["SITE_BUILD_DIR"] = str(base)
    return base


def record_strict_build(base: Path) -> None:
    """Build the real project into base/site and keep the finished process in base/build.json."""
    # Served at the root of a local server by the browser tests, whatever SITE_URL the
    # environment has; an EDIT_URI as the GitHub Pages workflow sets it, so edit links exist.
    # NOTEBOOKS_EXECUTE=always: the notebook runs for real, whatever .cache/ holds (and the
    # run refreshes the cache, so `tasks.py serve` starts warm after the suite). Under
    # --changed (SITE_BUILD_NOTEBOOKS=auto, tests/conftest.py) a cached run whose inputs are
    # unchanged is reused, as `serve` does.
    done = build(ROOT, base / "site", SITE_URL="http://127.0.0.1:8000/",
                 EDIT_URI="https://github.com/example/shared-params-docs/edit/main/docs/",
                 NOTEBOOKS_EXECUTE=os.environ.get("SITE_BUILD_NOTEBOOKS", "always"))
    (base / "build.json").write_text(json.dumps(
        {"args": done.args, "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}))


def start_strict_build() -> None:
    """Start the session's strict build in the background, unless it has started already.

    tests/conftest.py calls this as soon as the tests are collected, so the build (17 s:
    it executes the notebook) overlaps other tests instead of holding up the first test
    that needs it. The builder inherits the build lock and holds it until it is done.
    """
    base = build_base()
    try:
        os.close(os.open(base / "build.started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    with open(base / "build.lock", "w") as lock, open(base / "builder.log", "w") as log:
        fcntl.flock(lock, fcntl.LOCK_EX)
        builder = subprocess.Popen(
            [sys.executable, "-m", "rankrun.site_build", str(base)],
            cwd=ROOT, pass_fds=[lock.fileno()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
        )
    # The session kills the builder's process group if it ends before the build does (conftest.py).
    (base / "builder.pid").write_text(str(builder.pid))


@functools.cache
def strict_build():
    """The session's strict build of the real project: (the finished process, the site directory).

    Built once per session, by start_strict_build's builder or by the first caller, under a
    file lock; every caller reads the same record.
    """
    base = build_base()
    with open(base / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "build.json").exists():
            record_strict_build(base)
        done = subprocess.CompletedProcess(**json.loads((base / "build.json").read_text()))
    return done, base / "site"


def built_pages(site):
    """Every HTML page of a built site, 404.html included."""
    return sorted(site.rglob("*.html"))


if __name__ == "__main__":
    # The background builder (start_strict_build): holds the inherited lock until it exits;
    # builds unless a caller of strict_build got there first.
    if not (Path(sys.argv[1]) / "build.json").exists():
        record_strict_build(Path(sys.argv[1]))
