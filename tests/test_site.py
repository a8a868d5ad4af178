"""The site builds with `mkdocs build --strict`; a broken snippet include or a failing notebook
cell fails the build; every page carries the version stamp.

The strict build of the real project runs once per test session (it executes the notebook,
which starts a real 2-rank run); tests/site/ reuses it through `strict_build()`.
"""

import atexit
import fcntl
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import pytest

from rankrun.runner import ROOT

SITE_SOURCES = ["mkdocs.yml", "docs", "snippets", "overrides", "hooks", "versions"]
NOTEBOOK = Path("docs") / "notebooks" / "gather-and-release.py"


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
            [sys.executable, __file__, str(base)],
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


def test_site_builds_strict():
    result, site = strict_build()
    assert result.returncode == 0, result.stderr
    page = (site / "zero3" / "external-parameters" / "index.html").read_text()
    # The included snippet, its output file and the version stamp are on the page.
    assert "register_external_parameter" in page
    assert "step 0: loss" in page
    assert "--8&lt;--" not in page and "[start:model]" not in page


def test_every_page_shows_the_versions_it_was_verified_with():
    result, site = strict_build()
    assert result.returncode == 0, result.stderr
    pages = [page for page in built_pages(site) if page.name != "404.html"]
    assert len(pages) >= 6 and site / "notebooks" / "gather-and-release" / "index.html" in pages
    stamp = re.compile(rf"Examples verified with torch <code>{re.escape(version('torch'))}</code> and\s+"
                       rf"DeepSpeed <code>{re.escape(version('deepspeed'))}</code>")
    for page in pages:
        assert stamp.search(page.read_text()), f"{page.relative_to(site)} has no version stamp"


def test_the_notebook_ran_while_the_site_was_built():
    result, site = strict_build()
    assert result.returncode == 0, result.stderr
    page = (site / "notebooks" / "gather-and-release" / "index.html").read_text()
    assert "Converting notebook (execute=True)" in result.stderr
    assert "Notebook notebooks/gather-and-release.py: executing (" in result.stderr
    assert "reusing the run" not in result.stderr
    # Outputs exist only because the cells ran: the run's summary, the checks, the plot.
    # The losses the notebook prints are the recording script's: read them from its output file,
    # so `--update-outputs` after a change to the example is all this test needs.
    losses = re.search(r"^embeddings.weight registered: losses on rank 0 (\[.*\])$",
                       (ROOT / "snippets" / "notebooks" / "gather_timeline.out").read_text(), re.M).group(1)
    assert re.search(rf"registered: \d+ moments recorded, losses {re.escape(losses)}", page), losses
    assert "stage3_max_reuse_distance: 1000000000 parameter elements" in page
    assert "all checks passed" in page
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', page)) == 1
    # The notebook's source is offered for download next to the page.
    assert (site / "notebooks" / "gather-and-release" / "gather-and-release.py").read_text() == (ROOT / NOTEBOOK).read_text()


def test_the_build_prints_only_what_the_author_must_act_on():
    result, _ = strict_build()
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    # The Jupyter kernel talks to the build over IPC: no warning about unencrypted TCP.
    assert "without encryption" not in output and "[IPKernelApp]" not in output, output
    assert not re.search(r"^(WARNING|ERROR)\b", output, re.M), output


def test_every_page_has_an_edit_link_when_edit_uri_is_set():
    result, site = strict_build()
    assert result.returncode == 0, result.stderr
    base = "https://github.com/example/shared-params-docs/edit/main/docs/"
    for page, source in [("index.html", "index.md"),
                         ("zero3/external-parameters/index.html", "zero3/external-parameters.md"),
                         ("notebooks/gather-and-release/index.html", "notebooks/gather-and-release.py")]:
        assert f'href="{base}{source}"' in (site / page).read_text(), page


@pytest.fixture
def project_copy(tmp_path):
    copy = tmp_path / "project"
    for name in SITE_SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, copy / name)
    return copy


@pytest.fixture
def project_copy_without_notebook_runs(project_copy, monkeypatch):
    """A copy whose builds do not execute the notebook (NOTEBOOKS_EXECUTE=never, and not as CI,
    which always executes): for tests about snippet includes."""
    monkeypatch.setenv("NOTEBOOKS_EXECUTE", "never")
    monkeypatch.delenv("CI", raising=False)
    return project_copy


@pytest.mark.slow  # a second build, of a broken copy
def test_missing_snippet_section_fails_the_build(project_copy_without_notebook_runs, tmp_path):
    project_copy = project_copy_without_notebook_runs
    snippet = project_copy / "snippets" / "zero3" / "language_model.py"
    text = snippet.read_text()
    assert "# --8<-- [start:model]\n" in text
    snippet.write_text(text.replace("# --8<-- [start:model]\n", "").replace("# --8<-- [end:model]\n", ""))
    result = build(project_copy, tmp_path / "site")
    assert result.returncode != 0
    # One line that names the page, the include and what is missing; no tracebacks.
    assert ('docs/zero3/external-parameters.md:' in result.stderr and '--8<-- "snippets/zero3/language_model.py:model": '
            "snippets/zero3/language_model.py has no section 'model' (missing [start:model] and [end:model])"
            in result.stderr), result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("has no section") == 1, result.stderr


@pytest.mark.slow  # a second build, of a broken copy
def test_missing_snippet_file_fails_the_build(project_copy_without_notebook_runs, tmp_path):
    project_copy = project_copy_without_notebook_runs
    (project_copy / "snippets" / "zero3" / "language_model.out").unlink()
    result = build(project_copy, tmp_path / "site")
    assert result.returncode != 0
    assert '--8<-- "snippets/zero3/language_model.out": the file snippets/zero3/language_model.out does not exist' \
        in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow  # a second build, of a broken copy
def test_a_link_to_a_missing_heading_fails_the_build(project_copy_without_notebook_runs, tmp_path):
    """`--strict` alone lets `page.md#no-such-heading` through; `validation: anchors: warn`
    in mkdocs.yml makes it a warning, which --strict turns into a failed build."""
    page = project_copy_without_notebook_runs / "docs" / "zero3" / "sharing-cost.md"
    text = page.read_text()
    assert "automatic-detection.md#the-tables)" in text
    page.write_text(text.replace("automatic-detection.md#the-tables)", "automatic-detection.md#the-table)", 1))
    result = build(project_copy_without_notebook_runs, tmp_path / "site")
    assert result.returncode != 0
    assert "#the-table" in result.stderr and "anchor" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow  # a second build, of a broken copy
def test_failing_notebook_cell_fails_the_build(project_copy, tmp_path):
    notebook = project_copy / NOTEBOOK
    text = notebook.read_text()
    first_code_cell = "\n# %%\n"
    assert first_code_cell in text
    # A cell that fails before the notebook's run starts, so this build stays cheap.
    notebook.write_text(text.replace(first_code_cell, "\n# %%\nraise RuntimeError('deliberately broken cell')\n\n# %%\n", 1))
    result = build(project_copy, tmp_path / "site")
    assert result.returncode != 0
    stderr = re.sub(r"\x1b\[[0-9;]*m", "", result.stderr)  # the kernel's traceback is colored
    assert "CellExecutionError" in stderr and "RuntimeError: deliberately broken cell" in stderr, stderr[-3000:]
    assert "a cell failed, so the page cannot be built" in stderr


if __name__ == "__main__":
    # The background builder (start_strict_build): holds the inherited lock until it exits;
    # builds unless a caller of strict_build got there first.
    if not (Path(sys.argv[1]) / "build.json").exists():
        record_strict_build(Path(sys.argv[1]))
