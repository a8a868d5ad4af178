"""The site builds with `mkdocs build --strict`; a broken snippet include or a failing notebook
cell fails the build; every page carries the version stamp.

The strict build of the real project runs once per test session (it executes the notebook,
which starts a real 2-rank run): rankrun.site_build, which tests/site/ reuses too.
"""

import os
import re
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest

from rankrun.runner import ROOT
from rankrun.site_build import build, built_pages, strict_build

SITE_SOURCES = ["mkdocs.yml", "docs", "snippets", "overrides", "hooks", "versions"]
NOTEBOOK = Path("docs") / "notebooks" / "gather-and-release.py"


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
    executed = ("Converting notebook (execute=True)" in result.stderr
                and "Notebook notebooks/gather-and-release.py: executing (" in result.stderr)
    if os.environ.get("SITE_BUILD_NOTEBOOKS", "always") == "always":
        assert executed, result.stderr
        assert "reusing the run" not in result.stderr
    else:  # --changed: a cached run whose inputs did not change is reused, as `serve` does
        assert executed or "nothing it depends on changed" in result.stderr, result.stderr
    # Outputs exist only because the cells ran: the run's summary, the checks, the plot.
    # The losses the notebook prints are the recording script's: read them from its output file,
    # so `--update-outputs` after a change to the example is all this test needs.
    losses = re.search(r"^embeddings.weight registered: losses on rank 0 (\[.*\])$",
                       (ROOT / "snippets" / "notebooks" / "gather_timeline.out").read_text(), re.M).group(1)
    assert re.search(rf"registered: \d+ moments recorded, losses {re.escape(losses)}", page), losses
    assert "stage3_max_reuse_distance: 1000000000 parameter elements" in page
    assert "all checks passed" in page
    assert len(re.findall(r'<img [^>]*src="data:image/svg\+xml;base64,', page)) == 1  # text kept as text
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
