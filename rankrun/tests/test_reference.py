"""The snippet loader of the tests and benchmarks (rankrun.reference.example_namespace): a
snippet imports the modules of its folder as it does when run as a script, and the load leaves
sys.path and sys.modules as they were, so two folders may each have a module of the same name."""

import sys
import types

from rankrun.reference import example_namespace


def folder_of(root, name, **files):
    """A folder of snippets under `root`: each keyword a file name (without .py) and its text."""
    folder = root / name
    folder.mkdir()
    for stem, text in files.items():
        (folder / f"{stem}.py").write_text(text)
    return folder


def test_a_snippet_imports_its_siblings_and_the_load_leaves_nothing_behind(tmp_path):
    folder = folder_of(tmp_path, "a", base="WORD = 'base'\n", helper="from base import WORD\n",
                       example="from helper import WORD\n")
    path, modules = list(sys.path), set(sys.modules)
    assert example_namespace(folder / "example.py")["WORD"] == "base"
    assert sys.path == path
    assert set(sys.modules) == modules  # neither helper nor base, which helper imported


def test_same_named_siblings_in_two_folders_do_not_collide(tmp_path, monkeypatch):
    first = folder_of(tmp_path, "a", helper="WORD = 'a'\n", example="from helper import WORD\n")
    second = folder_of(tmp_path, "b", helper="WORD = 'b'\n", example="from helper import WORD\n")
    assert example_namespace(first / "example.py")["WORD"] == "a"
    assert example_namespace(second / "example.py")["WORD"] == "b"
    # A module of that name imported otherwise is not what the snippet gets, and stays imported.
    elsewhere = types.ModuleType("helper")
    elsewhere.WORD = "elsewhere"
    monkeypatch.setitem(sys.modules, "helper", elsewhere)
    assert example_namespace(second / "example.py")["WORD"] == "b"
    assert sys.modules["helper"] is elsewhere


def test_with_siblings_adds_their_globals_under_the_snippets_own(tmp_path):
    folder = folder_of(tmp_path, "a", helper="LR, STEPS, SEED = 0.5, 3, 0\n",
                       example="from helper import STEPS\nLR = 0.1\n")
    assert "SEED" not in example_namespace(folder / "example.py")
    names = example_namespace(folder / "example.py", with_siblings=["helper"])
    assert (names["LR"], names["STEPS"], names["SEED"]) == (0.1, 3, 0)  # the snippet's LR over its sibling's
