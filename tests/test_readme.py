"""The README is what a newcomer reads first: short, answering what this is, how to run it and
how to add an example, with every link resolving (to a file, and to a heading where it names
one). CONTRIBUTING.md holds what the README left out; its links are held to the same rule."""

import re

import pytest

from rankrun.runner import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def local_links(path) -> list[str]:
    return [target for target in LINK.findall(FENCE.sub("", path.read_text()))
            if not re.match(r"[a-z]+://", target)]


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_every_local_link_resolves(name):
    source = ROOT / name
    broken = []
    for target in local_links(source):
        file, _, anchor = target.partition("#")
        path = (source.parent / file) if file else source
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(ROOT)}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with the id {anchor!r} in {path.relative_to(ROOT)}")
    assert local_links(source), f"{name} links nothing"
    assert not broken, f"{name}: " + "; ".join(broken)


def test_the_anchor_rule_is_githubs():
    assert github_anchor(" The harness: `rankrun`") == "the-harness-rankrun"
    assert github_anchor("A run that prints nothing: a stale build lock") == (
        "a-run-that-prints-nothing-a-stale-build-lock")


def test_the_readme_is_short_and_answers_a_newcomers_three_questions():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 90, "README.md is for a newcomer: move details to CONTRIBUTING.md"
    for needed in ("python3 tasks.py serve", "python3 tasks.py test",
                   "DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/", "## Add an example",
                   "](CONTRIBUTING.md)"):
        assert needed in text, f"README.md lacks {needed!r}"


def test_the_harness_docstring_lists_every_module_of_the_harness():
    """README and CONTRIBUTING point to rankrun/__init__.py for the harness's modules."""
    import rankrun

    listed = set(re.findall(r"^    (\w+\.py) ", rankrun.__doc__, re.M))
    present = {path.name for path in (ROOT / "rankrun").glob("*.py") if path.name != "__init__.py"}
    assert listed == present, f"not listed: {sorted(present - listed)}; gone: {sorted(listed - present)}"
