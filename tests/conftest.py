"""This project's test setup besides the harness's plugin (rankrun.plugin): the session's
strict site build, started in the background and read by the tests that need it last."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path


def pytest_configure(config):  # after rankrun.plugin's (tryfirst): the session's TMPDIR is set
    if not hasattr(config, "workerinput"):
        # One strict build of the site per test session, shared by the pytest-xdist
        # workers (tests/test_site.py, strict_build).
        config.site_build_dir = tempfile.mkdtemp(prefix="site-build-")
        os.environ["SITE_BUILD_DIR"] = config.site_build_dir
        if config.getoption("--changed") and not os.environ.get("CI"):
            os.environ["SITE_BUILD_NOTEBOOKS"] = "auto"  # reuse the notebook's cached run if valid


def pytest_unconfigure(config):
    if hasattr(config, "site_build_dir"):
        base = Path(config.site_build_dir)
        builder = base / "builder.pid"
        if builder.exists() and not (base / "build.json").exists():  # the build did not finish
            try:
                os.killpg(int(builder.read_text()), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(config.site_build_dir, ignore_errors=True)


def reads_the_site_build(item) -> bool:
    return Path(str(item.fspath)).name == "test_site.py" or "site_dir" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    if config.getoption("--order") == "declared":
        # The tests that read the site build go last: the build starts in the background
        # when collection ends (pytest_collection_finish) and is done by the time they run.
        items.sort(key=reads_the_site_build)  # stable: the declared order otherwise


def pytest_collection_finish(session):
    """Start the strict site build now if a selected test reads it (see start_strict_build)."""
    if os.environ.get("SITE_BUILD_DIR") and any(reads_the_site_build(item) for item in session.items):
        from rankrun.site_build import start_strict_build

        start_strict_build()
