"""Which tests a change can affect: `pytest --changed` (and `python3 tasks.py test --changed`).

The change is what git sees in the working tree against HEAD (staged, unstaged and untracked
files that are not ignored), or against `--changed-base REV`. From it:

- a snippet (`snippets/<topic>/<name>.py` or its output file): its test module
  (`tests/<topic>/test_<name>.py`, the mirror), its item of `tests/test_snippets.py`, and the
  checks of every page that includes it;
- a page (`docs/...md`): the page-level checks of that page (its items of the page checks, the
  test module named after it), the strict site build, and the label checks of the output files it
  shows (`tests/test_snippets.py`, which run those examples); not the slow checks of the machinery
  among them (real torchrun's stderr, builds of broken copies), which a page's text cannot break
  (they run when an example they name with `@pytest.mark.runs(...)` changes);
- a test module: that module; the site's hooks, templates or the notebook: the site tests;
  the version data: `tests/test_versions.py`;
- the data of "Find your error" and the census (`docs/errors/`), those pages and their hooks:
  their two test modules (the search box's included), and for the data the pages' checks too;
- anything the whole suite rests on (the harness, `tasks.py` and `devtasks/`, the pins, `mkdocs.yml`,
  `tests/conftest.py`, CI): every test.

CI always runs everything; this is the loop for editing one example or page.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# Changes that can affect any test.
EVERYTHING = ("rankrun/", "tasks.py", "devtasks/", "pyproject.toml", "constraints.txt", "mkdocs.yml",
              "tests/conftest.py", ".ci/", "tests/prose_literals_allowlist.tsv")
SITE = ("hooks/", "overrides/", "docs/notebooks/", "docs/assets/")
# Modules whose tests are parametrized by page or snippet (their item ids name it).
PAGE_CHECKS = ("tests/test_prose_literals.py", "tests/test_inventory.py", "tests/test_output_blocks.py")
SITE_TESTS = ("tests/test_site.py", "tests/site/")
# "Find your error" and the census: rendered from the data in docs/errors/ by hooks; a change
# to the data, the pages or those hooks runs their tests (the search box's included).
ERRORS = ("docs/errors/", "hooks/errors_", "hooks/search_fixes.py")
ERRORS_PAGES = ("docs/errors/index.md", "docs/errors/census.md")
ERRORS_TESTS = ("tests/test_errors_data.py", "tests/site/test_find_your_error.py")
# The item of tests/test_snippets.py that reads a page's output-block labels.
LABEL_CHECK = "test_its_output_blocks_say_only_rank_0_prints_exactly_where_it_does"


def changed_files(root: Path, base: str = "HEAD") -> list[str]:
    """Paths (relative to root) that differ from `base`, plus untracked files git does not ignore."""
    def git(*args: str) -> list[str]:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"--changed needs git: `git {' '.join(args)}` failed: {done.stderr.strip()}")
        return [line for line in done.stdout.splitlines() if line]
    return sorted(set(git("diff", "--name-only", base, "--")) | set(git("ls-files", "--others", "--exclude-standard")))


@dataclass
class Affected:
    everything: bool = False
    test_files: set[str] = field(default_factory=set)
    snippets: set[str] = field(default_factory=set)  # snippets/<topic>/<name>.py
    pages: set[str] = field(default_factory=set)  # docs/...md
    labelled: set[str] = field(default_factory=set)  # snippets whose output a changed page shows
    site: bool = False

    def may_select_file(self, path: str) -> bool:
        """Whether some item of the test file `path` (from the project root) may be selected:
        the others are not even collected (importing a test module can cost seconds)."""
        if self.everything or path in self.test_files:
            return True
        if any(path == mirror_test(snippet) for snippet in self.snippets):
            return True
        if any(path == page_test(page) for page in self.pages):
            return True
        if path == "tests/test_snippets.py":
            return bool(self.snippets or self.labelled)
        if path in PAGE_CHECKS:
            return bool(self.snippets or self.pages)
        if path.startswith(SITE_TESTS):
            return self.site or (bool(self.pages) and path == "tests/test_site.py")
        return False

    def selects(self, nodeid: str, slow: bool = False, runs: tuple[str, ...] = ()) -> bool:
        """Whether the test `nodeid` is selected. `slow`: it is marked slow (a check of the
        machinery: real torchrun, a broken copy's build); such a check among the page checks and
        the site tests runs only for a change of its own module, of the site, or of an example it
        runs (`runs`, from its `@pytest.mark.runs(...)`): a page's text cannot break it."""
        if self.everything:
            return True
        path, _, rest = nodeid.partition("::")
        if path in self.test_files:
            return True
        if slow and (path in PAGE_CHECKS or path.startswith(SITE_TESTS)):
            return self.site and path.startswith(SITE_TESTS) or any(snippet in self.snippets for snippet in runs)
        if any(path == mirror_test(snippet) for snippet in self.snippets):
            return True
        if any(path == page_test(page) for page in self.pages):
            return True
        if path == "tests/test_snippets.py":
            return (any(snippet in rest for snippet in self.snippets)
                    or (rest.startswith(LABEL_CHECK) and any(f"[{snippet}]" in rest for snippet in self.labelled)))
        if path in PAGE_CHECKS:
            if "[" not in rest:  # a check of the whole project (the allow-list, the mirror): cheap
                return bool(self.snippets or self.pages)
            names = {*self.snippets, *(str(Path(s).with_suffix(".out")) for s in self.snippets),
                     *self.pages, *(page.removeprefix("docs/") for page in self.pages)}
            return any(name in rest for name in names)
        if path.startswith(SITE_TESTS):
            return self.site or (bool(self.pages) and path == "tests/test_site.py")
        return False


def mirror_test(snippet: str) -> str:
    """tests/<topic>/test_<name>.py for snippets/<topic>/<name>.py."""
    parts = Path(snippet).with_suffix("").parts
    return str(Path("tests", *parts[1:-1], f"test_{parts[-1]}.py"))


def page_test(page: str) -> str:
    """tests/<section>/test_<page>.py for docs/<section>/<page>.md (dashes as underscores)."""
    parts = Path(page).with_suffix("").parts
    return str(Path("tests", *parts[1:-1], f"test_{parts[-1].replace('-', '_')}.py"))


def affected(changed: list[str], pages_including, outputs_shown=lambda page: []) -> Affected:
    """What `changed` can affect; `pages_including(path)` names the pages that include a file,
    `outputs_shown(page)` the output files (snippets/...out) in a page's output blocks."""
    result = Affected()
    for path in changed:
        if path.startswith(ERRORS):
            result.test_files.update(ERRORS_TESTS)
            if path.startswith("docs/errors/"):
                result.pages.update(ERRORS_PAGES)
        if path.startswith(EVERYTHING):
            result.everything = True
        elif path.startswith(SITE):
            result.site = True
        elif path.startswith("snippets/") and path.endswith((".py", ".out")):
            result.snippets.add(str(Path(path).with_suffix(".py")))
            result.pages.update(pages_including(path))
            result.pages.update(pages_including(str(Path(path).with_suffix(".py"))))
        elif path.startswith("snippets/"):  # another included file (rendered notes, data)
            result.pages.update(pages_including(path))
        elif path.startswith("docs/") and path.endswith(".md"):
            result.pages.add(path)
            result.labelled.update(str(Path(output).with_suffix(".py")) for output in outputs_shown(path))
        elif path.startswith("tests/") and path.endswith(".py"):
            result.test_files.add(path)
        elif path.startswith("versions/"):
            result.test_files.add("tests/test_versions.py")
    return result
