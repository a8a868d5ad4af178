"""`python3 tasks.py notebook` works as the notebook page says: JupyterLab, started the way
tasks.py starts it, opens docs/notebooks/gather-and-release.py as a notebook (jupytext), and
Run > Run All Cells runs every cell to the end in the project's environment.

The server runs on a copy of the project's pages and snippets, so JupyterLab's autosave cannot
write to the real notebook; Chromium (the browser tests' one) clicks through JupyterLab.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from runner import ROOT

spec = importlib.util.spec_from_file_location("tasks", ROOT / "tasks.py")
tasks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tasks)

pytestmark = pytest.mark.slow  # JupyterLab, Chromium and a real 2-rank run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab as `tasks.py notebook` starts it, on a copy of the project: (url, token, copy)."""
    copy = tmp_path / "project"
    for name in ("docs", "snippets"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "vendor"))
    port, token = free_port(), secrets.token_hex(16)
    command = tasks.jupyter_lab_command(
        ["--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         f"--IdentityProvider.token={token}"], root=copy)
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(command, cwd=copy, env=tasks.jupyter_environment(), stdout=log,
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


def test_tasks_notebook_opens_and_runs_the_notebook_in_jupyterlab(browser_context, jupyterlab):
    url, token, copy = jupyterlab
    page = browser_context.new_page()
    try:
        page.set_default_timeout(120_000)
        page.goto(f"{url}/lab/tree/{tasks.NOTEBOOK}?token={token}")
        # Opened as a notebook, not as a text file: its cells are there, and its kernel is idle.
        page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for()
        assert page.locator(".jp-FileEditor").count() == 0
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").click()
        page.locator(".lm-Menu .lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
        outputs = page.locator(".jp-NotebookPanel .jp-OutputArea-output")
        page.wait_for_function(
            "() => [...document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output')]"
            ".some(o => o.innerText.includes('all checks passed')"
            " || o.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr'"
            " || o.querySelector('.jp-RenderedText[data-mime-type=\"application/vnd.jupyter.error\"]'))",
            timeout=900_000)
        text = "\n".join(outputs.all_inner_texts())
        assert "all checks passed" in text, text[-3000:]
        assert "registered: 20 moments recorded, losses [3.7219, 4.0055]" in text
        assert page.locator(".jp-NotebookPanel .jp-OutputArea-output img").count() == 1
    finally:
        page.close()
