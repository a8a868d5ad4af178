"""The notebook cache (hooks/notebooks.py): a build reuses a notebook's executed output only while
nothing the output depends on changed, and CI never reuses it.

Checked on a tiny project with the real hook: its notebook runs a script (as the walkthrough
runs gather_timeline.py with torchrun) that loads a helper module and reads a data file.
Changing the notebook, the script, the helper, the data file, or the torch or DeepSpeed
version invalidates the cached output; changing a file the run did not read does not.
A failing cell fails the build even when an older output is cached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from rankrun.runner import ROOT

NOTEBOOK = '''\
# %% [markdown]
# # Tiny

# %%
import subprocess, sys
from pathlib import Path
root = Path.cwd().parents[1]
print(subprocess.run([sys.executable, "snippets/tiny/run.py"], cwd=root,
                     capture_output=True, text=True, check=True).stdout)
'''
FILES = {
    "mkdocs.yml": "site_name: tiny\nstrict: true\nhooks:\n  - hooks/notebooks.py\n"
                  "nav:\n  - Home: index.md\n  - Tiny: notebooks/tiny.py\n",
    "docs/index.md": "# Home\n",
    "docs/notebooks/tiny.py": NOTEBOOK,
    # Run as `python snippets/tiny/run.py`, it imports its sibling as the examples do theirs.
    "snippets/tiny/run.py": "import helper\n"
                            "print('data:', open('snippets/tiny/data.txt').read().strip(), helper.WORD)\n",
    "snippets/tiny/helper.py": "WORD = 'hello'\n",
    "snippets/tiny/data.txt": "1\n",
    "snippets/tiny/unrelated.py": "print('not read by the notebook')\n",
}
SRC_URI = "notebooks/tiny.py"

pytestmark = pytest.mark.slow  # builds of a project whose notebook runs (a Jupyter kernel each)


def load_hook():
    spec = importlib.util.spec_from_file_location("notebooks_hook", ROOT / "hooks" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = load_hook()


def build(project: Path, **env) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of the tiny project, not as CI and without NOTEBOOKS_EXECUTE
    unless `env` sets them."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "CI": None, "NOTEBOOKS_EXECUTE": None, **env}
    env = {name: value for name, value in env.items() if value is not None}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(project / "site")],
                          cwd=project, env=env, capture_output=True, text=True, timeout=600)


def page_of(project: Path) -> str:
    return (project / "site" / "notebooks" / "tiny" / "index.html").read_text()


def executed(result) -> bool:
    assert result.returncode == 0, result.stderr
    ran = "Notebook notebooks/tiny.py: executing" in result.stderr
    reused = "Notebook notebooks/tiny.py: reusing the run" in result.stderr
    assert ran != reused, result.stderr
    return ran


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The tiny project, built once: its notebook has run and its output is cached."""
    root = tmp_path_factory.mktemp("tiny") / "project"
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "hooks").mkdir()
    shutil.copy(ROOT / "hooks" / "notebooks.py", root / "hooks" / "notebooks.py")
    first = build(root)
    assert executed(first)
    assert "executing (no earlier run cached)" in first.stderr
    assert "data: 1 hello" in page_of(root)
    return root


@pytest.fixture
def entry(project):
    """The cache entry's path and the key the current files and versions give."""
    return hook.cache_file(project, SRC_URI), hook.cache_key(project / "docs" / SRC_URI)


def test_the_run_records_every_project_file_it_read(project, entry):
    cached = json.loads(entry[0].read_text())
    # The script, the module it imports, the file it reads; not the notebook (it is in the
    # key), not the file no run touched.
    assert sorted(cached["inputs"]) == ["snippets/tiny/data.txt", "snippets/tiny/helper.py", "snippets/tiny/run.py"]
    # The kernel's IPC sockets went to a temporary directory, not next to the notebook.
    assert [p.name for p in (project / "docs" / "notebooks").iterdir()] == ["tiny.py"]


def test_nothing_changed_reuses_the_output(project, entry):
    assert hook.reusable(project, *entry)[0] is not None
    again = build(project)
    assert not executed(again)
    assert "Converting notebook" not in again.stderr
    assert "data: 1 hello" in page_of(project)


@pytest.mark.parametrize("changed", ["snippets/tiny/run.py", "snippets/tiny/helper.py", "snippets/tiny/data.txt"])
def test_changing_a_file_the_run_read_invalidates_it(project, entry, changed):
    path = project / changed
    original = path.read_text()
    try:
        path.write_text(original + "\n# changed\n" if changed.endswith(".py") else "2\n")
        cached, why = hook.reusable(project, *entry)
        assert cached is None and why == f"{changed}, which the last run read, changed"
    finally:
        path.write_text(original)
    assert hook.reusable(project, *entry)[0] is not None


def test_changing_a_file_the_run_did_not_read_keeps_it(project, entry):
    path = project / "snippets" / "tiny" / "unrelated.py"
    original = path.read_text()
    try:
        path.write_text(original + "print('changed')\n")
        assert hook.reusable(project, *entry)[0] is not None
    finally:
        path.write_text(original)


def test_changing_the_notebook_invalidates_it(project, entry):
    notebook = project / "docs" / SRC_URI
    original = notebook.read_text()
    try:
        notebook.write_text(original + "\n# %%\nprint('one more cell')\n")
        key = hook.cache_key(notebook)
        assert key != entry[1]
        cached, why = hook.reusable(project, entry[0], key)
        assert cached is None and "the notebook" in why
    finally:
        notebook.write_text(original)


@pytest.mark.parametrize("package", ["torch", "deepspeed"])
def test_another_torch_or_deepspeed_version_invalidates_it(project, entry, package):
    notebook = project / "docs" / SRC_URI
    versions = {name: hook.installed(name) for name in hook.VERSIONED}
    assert hook.cache_key(notebook, versions) == entry[1]  # the key is these versions
    assert versions[package] == version(package)
    other = {**versions, package: versions[package] + ".post1"}
    cached, why = hook.reusable(project, entry[0], hook.cache_key(notebook, other))
    assert cached is None and "versions" in why


def test_an_edit_shows_the_new_output_never_the_stale_one(project, entry):
    data = project / "snippets" / "tiny" / "data.txt"
    cached = entry[0].read_text()
    data.write_text("3\n")
    try:
        result = build(project)
        assert executed(result)
        assert "executing (snippets/tiny/data.txt, which the last run read, changed)" in result.stderr
        assert "data: 3 hello" in page_of(project)
    finally:
        data.write_text("1\n")
        entry[0].write_text(cached)  # the first run's entry, valid again for the files as they were


def test_ci_executes_even_with_a_valid_cache(project, entry):
    assert hook.reusable(project, *entry)[0] is not None
    result = build(project, CI="true")
    assert executed(result)
    assert "Notebook notebooks/tiny.py: executing (CI is set: output is never reused in CI)" in result.stderr


@pytest.mark.parametrize("env, forced, skipped", [
    ({}, None, False),
    ({"NOTEBOOKS_EXECUTE": "always"}, "NOTEBOOKS_EXECUTE=always", False),
    ({"CI": "true"}, "CI is set: output is never reused in CI", False),
    ({"NOTEBOOKS_EXECUTE": "never"}, None, True),
    ({"CI": "true", "NOTEBOOKS_EXECUTE": "never"}, "CI is set: output is never reused in CI", False),
])
def test_when_notebooks_must_run(monkeypatch, env, forced, skipped):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("NOTEBOOKS_EXECUTE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hook.forced() == forced
    assert hook.skipped() == skipped


def test_a_failing_cell_fails_the_build_even_with_an_older_output_cached(project, entry):
    notebook = project / "docs" / SRC_URI
    original = notebook.read_text()
    before = entry[0].read_text()
    try:
        notebook.write_text(original + "\n# %%\nraise ValueError('broken on purpose')\n")
        result = build(project)
        assert result.returncode != 0
        stderr = re.sub(r"\x1b\[[0-9;]*m", "", result.stderr)  # the kernel's traceback is colored
        assert "a cell failed, so the page cannot be built" in stderr
        assert "ValueError: broken on purpose" in stderr
        assert entry[0].read_text() == before  # the failed run cached nothing
    finally:
        notebook.write_text(original)
