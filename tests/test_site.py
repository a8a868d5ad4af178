"""The site builds with `mkdocs build --strict`, and a broken snippet include fails the build."""

import os
import shutil
import subprocess
import sys

import pytest

from runner import ROOT

SITE_SOURCES = ["mkdocs.yml", "docs", "snippets", "overrides", "hooks"]


def build(project_dir, site_dir):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=project_dir, env=env, capture_output=True, text=True, timeout=300,
    )


def test_site_builds_strict(tmp_path):
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "site" / "zero3" / "external-parameters" / "index.html").read_text()
    # The included snippet, its output file and the version stamp are on the page.
    assert "register_external_parameter" in page
    assert "step 0: loss" in page
    assert "--8&lt;--" not in page and "[start:model]" not in page
    from importlib.metadata import version
    assert f"<code>{version('deepspeed')}</code>" in page
    assert f"<code>{version('torch')}</code>" in page


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


def test_missing_snippet_section_fails_the_build(project_copy, tmp_path):
    snippet = project_copy / "snippets" / "zero3" / "language_model.py"
    text = snippet.read_text()
    assert "# --8<-- [start:model]\n" in text
    snippet.write_text(text.replace("# --8<-- [start:model]\n", "").replace("# --8<-- [end:model]\n", ""))
    result = build(project_copy, tmp_path / "site")
    assert result.returncode != 0
    assert "Snippet section 'model' could not be located" in result.stderr, result.stderr


def test_missing_snippet_file_fails_the_build(project_copy, tmp_path):
    (project_copy / "snippets" / "zero3" / "language_model.out").unlink()
    result = build(project_copy, tmp_path / "site")
    assert result.returncode != 0
    assert "language_model.out" in result.stderr, result.stderr
