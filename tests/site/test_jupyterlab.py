"""`python3 tasks.py notebook` works as the notebook page says: JupyterLab, started the way
tasks.py starts it, opens docs/notebooks/gather-and-release.py as a notebook (jupytext), with
the file's cells and the `python3` kernel of the project's environment.

That every cell then runs to the end in that kernel is what the strict build checks
(hooks/notebooks.py runs the same notebook with the same kernel, started in the notebook's
directory as JupyterLab starts it). Clicking Run > Run All Cells here was not made reliable.

The server runs on a copy of the project's pages and snippets, so JupyterLab's autosave cannot
write to the real notebook; Chromium (the browser tests' one) clicks through JupyterLab.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from devtasks import notebook
from rankrun.runner import ROOT
from rankrun.project import free_port

pytestmark = pytest.mark.slow  # JupyterLab and Chromium


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab as `tasks.py notebook` starts it, on a copy of the project: (url, token, copy)."""
    copy = tmp_path / "project"
    for name in ("docs", "snippets"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "vendor"))
    port, token = free_port(), secrets.token_hex(16)
    command = notebook.jupyter_lab_command(
        ["--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         f"--IdentityProvider.token={token}"], root=copy)
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(command, cwd=copy, env=notebook.jupyter_environment(), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{(tmp_path / 'jupyterlab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield url, token, copy
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()


def test_tasks_notebook_opens_the_notebook_in_jupyterlab(browser_context, jupyterlab):
    url, token, copy = jupyterlab
    # The server reads the .py as a notebook (jupytext), with the file's cells ...
    with urllib.request.urlopen(f"{url}/api/contents/{notebook.NOTEBOOK}?type=notebook&token={token}") as response:
        served = json.load(response)
    import jupytext  # 3 s of CPU: imported by the worker that runs this test, not at every collection

    expected = jupytext.read(copy / notebook.NOTEBOOK)
    assert served["type"] == "notebook"
    assert [c["source"] for c in served["content"]["cells"]] == [c["source"] for c in expected.cells]
    assert served["content"]["metadata"]["kernelspec"]["name"] == "python3"
    # ... and JupyterLab shows it as a notebook, not as a text file.
    page = browser_context.new_page()
    try:
        page.set_default_timeout(180_000)
        page.goto(f"{url}/lab/tree/{notebook.NOTEBOOK}?token={token}")
        # The notebook widget (it renders cells lazily, as they scroll into view).
        page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for()
        assert page.locator(".jp-FileEditor").count() == 0
    finally:
        page.close()
