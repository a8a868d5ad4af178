"""The `notebook` command: the walkthrough notebook in JupyterLab, on the project's environment.

tests/site/test_jupyterlab.py starts JupyterLab the same way (jupyter_lab_command,
jupyter_environment) and checks that the notebook opens as one.
"""

from __future__ import annotations

import os
from pathlib import Path

from devtasks.checkout import PYTHON, ROOT
from devtasks.child_env import environment
from devtasks.supervision import run_child

NOTEBOOK = "docs/notebooks/gather-and-release.py"
# JupyterLab opens a jupytext .py as text by default; these settings make its default
# viewer jupytext's notebook, so the walkthrough opens as a notebook at once.
JUPYTERLAB_SETTINGS = ROOT / ".cache" / "jupyterlab-settings"


def notebook(rest: list[str]) -> int:
    """JupyterLab with `rest` (its options), until it ends."""
    return run_child(jupyter_lab_command(rest), cwd=ROOT, env=jupyter_environment())


def jupyter_environment() -> dict[str, str]:
    settings = JUPYTERLAB_SETTINGS / "@jupyterlab" / "docmanager-extension" / "plugin.jupyterlab-settings"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text('{"defaultViewers": {"python": "Jupytext Notebook"}}\n')
    return {**environment(), "JUPYTERLAB_SETTINGS_DIR": str(JUPYTERLAB_SETTINGS)}


def jupyter_lab_command(rest: list[str], root: Path = ROOT) -> list[str]:
    """JupyterLab on the project's environment, rooted at the checkout, opening the notebook."""
    as_root = ["--allow-root"] if os.geteuid() == 0 else []  # containers and CI run as root
    return [str(PYTHON), "-m", "jupyterlab", f"--ServerApp.root_dir={root}", *as_root, *rest, NOTEBOOK]
