"""Pages, snippets, output files and tests stay in step.

Every file under snippets/ is included by a page; every `--8<--` reference in docs/ points at a
file and section that exist; every snippet documents its torchrun command (the command
tests/test_snippets.py runs it with) and has an output file.
"""

import re
import subprocess
from pathlib import Path

import pytest

from rankrun.entry import ENDING, ends_without_shutdown
from rankrun.pages import DOCS, TORCHRUN, all_snippets, documented_world_size, includes, output_file
from rankrun.runner import ROOT, SNIPPETS



def test_pages_include_snippets():
    assert includes(), "no page includes any snippet"


@pytest.mark.parametrize("page, path, section", includes(), ids=lambda v: str(v))
def test_every_include_points_at_a_real_file_and_section(page, path, section):
    target = ROOT / path
    assert target.is_file(), f"{page} includes {path}, which does not exist"
    assert target.resolve().is_relative_to(SNIPPETS), f"{page} includes {path}, outside snippets/"
    if section is not None:
        text = target.read_text()
        for marker in (f"[start:{section}]", f"[end:{section}]"):
            assert marker in text, f"{page} includes section {section!r} of {path}, which has no {marker}"


def snippet_files():
    return sorted(p.relative_to(ROOT) for p in SNIPPETS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


@pytest.mark.parametrize("snippet_file", snippet_files(), ids=str)
def test_every_snippet_file_is_included_by_a_page(snippet_file):
    included = {path for _, path, _ in includes()}
    assert str(snippet_file) in included, f"{snippet_file} is not included by any page in docs/"


@pytest.mark.parametrize("snippet", all_snippets(), ids=str)
def test_every_snippet_is_run_by_the_suite_and_has_an_output_file(snippet):
    # tests/test_snippets.py runs every snippet with the rank count of its documented
    # command; a snippet without one could not be run there.
    assert documented_world_size(snippet) >= 1
    assert output_file(snippet).is_file(), f"{snippet} has no output file {output_file(snippet).relative_to(ROOT)}"


def test_commands_on_pages_match_the_snippets():
    commands = [(page, int(n), path) for page in DOCS.rglob("*.md") for n, path in TORCHRUN.findall(page.read_text())]
    assert commands, "no page shows how to run an example"
    for page, world_size, path in commands:
        assert (ROOT / path).is_file(), f"{page.relative_to(ROOT)} shows a command for {path}, which does not exist"
        assert world_size == documented_world_size(path), (
            f"{page.relative_to(ROOT)} runs {path} on {world_size} ranks; the snippet documents "
            f"{documented_world_size(path)}"
        )


MARKER = re.compile(r"--8<--\s*\[(start|end):([^\]]*)\]")


def section_markers(snippet_file):
    """(line number, 'start' or 'end', name) of every section marker in a snippet file."""
    lines = (ROOT / snippet_file).read_text().splitlines()
    return [(number, kind, name) for number, line in enumerate(lines, 1) for kind, name in MARKER.findall(line)]


@pytest.mark.parametrize("snippet_file", [s for s in snippet_files() if s.suffix == ".py"], ids=str)
def test_every_section_marker_is_matched_and_used_by_a_page(snippet_file):
    """A start without an end (or the other way round), or a section no page includes, is a typo
    or a leftover: `[start:modl]` would otherwise go unnoticed until a page asks for `model`."""
    open_sections, problems = {}, []
    for number, kind, name in section_markers(snippet_file):
        if kind == "start":
            if name in open_sections:
                problems.append(f"line {number}: [start:{name}] again before its [end:{name}]")
            open_sections[name] = number
        elif open_sections.pop(name, None) is None:
            problems.append(f"line {number}: [end:{name}] without a [start:{name}] before it")
    problems += [f"line {number}: [start:{name}] has no [end:{name}]" for name, number in open_sections.items()]
    used = {section for _, path, section in includes() if path == str(snippet_file)}
    names = {name for _, kind, name in section_markers(snippet_file) if kind == "start"}
    problems += [f"section {name!r} is included by no page in docs/" for name in sorted(names - used)]
    assert not problems, f"{snippet_file}:\n  " + "\n  ".join(problems)


def test_an_output_mismatch_names_the_pages_shows_the_whole_diff_and_how_to_update():
    from rankrun.plugin import output_mismatch

    out = ROOT / "snippets" / "zero3" / "language_model.out"
    expected = "".join(f"line {i}\n" for i in range(40))
    actual = expected.replace("line 3\n", "line three\n").replace("line 37\n", "line thirty-seven\n")
    report = output_mismatch("snippets/zero3/language_model.py", out, expected, actual)
    assert report.startswith("snippets/zero3/language_model.py printed something else than "
                             "snippets/zero3/language_model.out, which is shown on docs/zero3/external-parameters.md")
    assert "-line 3\n+line three\n" in report and "-line 37\n+line thirty-seven\n" in report  # not truncated
    assert report.rstrip().endswith("python3 tasks.py test --update-outputs && git diff snippets/")


def hard_coded_devices(source: str) -> list[str]:
    """What in `source` fixes the CPU instead of asking where the rank runs: a backend name as a
    string literal ("gloo", "nccl"), or torch.device("cpu") outside the function that asks
    (this_ranks_device, whose CPU branch is what ran here)."""
    import ast

    found = []

    def visit(node, function=None):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Constant) and node.value in ("gloo", "nccl"):
            found.append(f"line {node.lineno}: backend {node.value!r} written out")
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.device"
                and [ast.unparse(a) for a in node.args] == ["'cpu'"] and function != "this_ranks_device"):
            found.append(f"line {node.lineno}: torch.device('cpu') written out")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source))
    return found


@pytest.mark.parametrize("snippet", all_snippets(), ids=str)
def test_no_snippet_fixes_the_cpu(snippet):
    """The snippets run here on CPU only, but they do not hard-code it: the backend comes from
    the device (DeepSpeed's get_accelerator(), or torch's for the examples without DeepSpeed),
    so the GPU claim on the pages is no more than 'not run there'."""
    assert hard_coded_devices((ROOT / snippet).read_text()) == []


def test_the_device_check_finds_what_it_looks_for():
    source = ('import torch\nimport torch.distributed as dist\n'
              'def this_ranks_device():\n    return torch.device("cpu")\n'
              'def main():\n    dist.init_process_group("gloo")\n    x = torch.zeros(1, device=torch.device("cpu"))\n')
    assert hard_coded_devices(source) == ["line 6: backend 'gloo' written out",
                                          "line 7: torch.device('cpu') written out"]


def example_test_modules():
    """The per-example test modules: tests/<folder>/test_*.py for every folder of snippets/."""
    return sorted(path.relative_to(ROOT) for folder in SNIPPETS.iterdir() if (ROOT / "tests" / folder.name).is_dir()
                  for path in (ROOT / "tests" / folder.name).glob("test_*.py"))


@pytest.mark.parametrize("module", example_test_modules(), ids=str)
def test_tests_mirror_the_snippets(module):
    """tests/ mirrors snippets/ (as FastAPI's tests/test_tutorial/ mirrors docs_src/): a test module
    in tests/<folder>/ is named after the snippet it tests (snippets/<folder>/<name>.py), or
    after the page whose claims it checks (docs/**/<name>.md, dashes as underscores)."""
    name = module.stem.removeprefix("test_")
    snippet = SNIPPETS / module.parent.name / f"{name}.py"
    pages = [page for page in DOCS.rglob("*.md") if page.stem.replace("-", "_") == name]
    assert snippet.is_file() or pages, (
        f"{module} is named after no snippet ({snippet.relative_to(ROOT)} does not exist) and no page in docs/")


def test_the_mirror_check_sees_every_example_folder():
    folders = {module.parent.name for module in example_test_modules()}
    assert folders == {"zero3", "pipeline", "transformers", "notebooks"}


# The project's internal names: its seeds and its own tracker's issues (the word "issue" and a
# bare number): a reader cannot resolve them. Public ones carry a "#" ("issue #876").
INTERNAL_NAME = re.compile(r"\bseeds?[ _-]?0\d\d\b|shared[/]seeds|\bissues? \d+\b", re.IGNORECASE)


def test_pages_and_code_cite_issues_by_their_public_names():
    """The issues behind the site are DeepSpeed issue #876, #1047 and PyTorch issue #51931 to a
    reader; the project's internal names appear nowhere a reader or a contributor reads."""
    code = [path for folder in ("rankrun", "devtasks", "tests", "benchmarks", "versions", "hooks")
            for path in (ROOT / folder).rglob("*")
            if path.suffix in {".py", ".toml", ".md", ".tsv"} and "__pycache__" not in path.parts]
    readable = [*DOCS.rglob("*.md"), *DOCS.rglob("*.py"), *SNIPPETS.rglob("*.py"), *SNIPPETS.rglob("*.out"),
                *SNIPPETS.rglob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "tasks.py", *code]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in readable
             for n, line in enumerate(path.read_text().splitlines(), 1) if INTERNAL_NAME.search(line)]
    assert found == []
    assert INTERNAL_NAME.search(f"as seed {'002'} showed") and not INTERNAL_NAME.search("torch.manual_seed(0)")
    assert INTERNAL_NAME.search(f"# Issue {17}, item 5: why") and not INTERNAL_NAME.search("DeepSpeed issue #1047")


def imported_test_modules(source: str) -> list[str]:
    """The test modules (`test_*`, `conftest`) a module imports: a test module holds tests, and
    shared code lives in rankrun (a test module imported by another works only because pytest
    puts its folder on sys.path, and runs its tests' module-level code twice)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:  # a harness test's deliberately broken example, not code
        return []
    found = []
    for node in ast.walk(tree):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [name for name in names if name.split(".")[-1].startswith(("test_", "conftest"))
                  or name.startswith("tests")]
        # ... or runs one by path (runpy.run_path, importlib's spec_from_file_location)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in {
                "run_path", "spec_from_file_location"}:
            found += [part.value for argument in node.args for part in ast.walk(argument)
                      if isinstance(part, ast.Constant) and isinstance(part.value, str)
                      and part.value.rsplit("/", 1)[-1].startswith(("test_", "conftest"))]
    return found


def test_no_test_module_imports_another():
    modules = sorted(path for folder in ("tests", "rankrun", "devtasks", "benchmarks", "hooks", "versions")
                     for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts)
    found = {str(path.relative_to(ROOT)): imported_test_modules(path.read_text()) for path in modules}
    assert {path: names for path, names in found.items() if names} == {}
    assert imported_test_modules("from test_site import strict_build\nimport os") == ["test_site"]
    assert imported_test_modules("from tests.site.conftest import x") == ["tests.site.conftest"]
    assert imported_test_modules("from rankrun.site_build import strict_build") == []
    assert imported_test_modules('runpy.run_path(str(ROOT / "tests/zero3/test_x.py"))') == ["tests/zero3/test_x.py"]


# A snippet whose ranks do collectives: it starts a process group itself or through DeepSpeed,
# Accelerate, Trainer or Megatron, or uses torch.distributed.
COLLECTIVES = re.compile(r"init_distributed|init_process_group|deepspeed\.(initialize|comm|zero\.Init)|PartialState"
                         r"|\bTrainer\b|Accelerator\(|torch\.distributed|parallel_state")
THE_ENDING = 'if __name__ == "__main__":\n    main()\n' + "".join(f"    {line}\n" for line in ENDING)


def snippets_with_collectives():
    return [s for s in snippet_files() if s.suffix == ".py" and COLLECTIVES.search((ROOT / s).read_text())]


def test_the_examples_with_collectives_are_found():
    assert len(snippets_with_collectives()) >= 50
    assert Path("snippets/zero3/language_model.py") in snippets_with_collectives()


@pytest.mark.parametrize("snippet_file", snippets_with_collectives(), ids=str)
def test_every_example_with_collectives_ends_without_python_shutdown(snippet_file):
    """gloo's worker threads outlive destroy_process_group() while DeepSpeed keeps the groups
    referenced; one that gives back its last work while Python shuts down aborts the process
    (docs/versions.md, "An abort at exit"). So the main block ends with os._exit."""
    assert ends_without_shutdown(ROOT / snippet_file), (
        f"{snippet_file} does collectives, and its main block does not end the way the examples end:\n"
        f"{THE_ENDING}(another exit code in os._exit(...) is fine; see docs/versions.md, \"An abort at exit\")")


@pytest.mark.parametrize("main_block, ends", [
    ("    main()\n", False),
    ("    main()\n    sys.stdout.flush()\n    os._exit(0)\n", True),
    ("    code = main()\n    sys.stdout.flush()\n    os._exit(code)\n", True),
    ("    main()\n    os._exit(0)\n", False),  # its buffered output would be lost
    ("    main()\n    os._exit(0)\n    sys.stdout.flush()\n", False),
    ("    main()\n    sys.stdout.flush()\n    sys.exit(0)\n", False),
])
def test_the_ending_check_tells_the_ending_from_others(tmp_path, main_block, ends):
    example = tmp_path / "example.py"
    example.write_text("import os\nimport sys\n\n\ndef main():\n    pass\n\n\nif __name__ == \"__main__\":\n" + main_block)
    assert ends_without_shutdown(example) is ends


LONGEST_MODULE = 450  # lines: a longer file holds several concerns; split it by concern


def test_no_python_file_is_longer_than_one_concern_needs():
    """Every Python file of the project stays under LONGEST_MODULE lines, except an example a page
    shows whole (a reader sees the file as it is, so it is not split for the rule)."""
    shown_whole = {path for _, path, section in includes() if section is None and path.endswith(".py")}
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    long = [f"{name}: {lines} lines" for name in tracked if name not in shown_whole
            and (lines := len((ROOT / name).read_text().splitlines())) > LONGEST_MODULE]
    assert not long, long
    assert "snippets/zero3/check_shared_reads.py" in shown_whole  # the rule sees whole includes


PACKAGES = ("rankrun", "versions", "devtasks", "hooks", "benchmarks", "tests")


def imports_between_folders() -> dict[str, set[str]]:
    """folder -> the other project folders (and tasks.py) its Python files import."""
    import ast

    found = {folder: set() for folder in PACKAGES}
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            try:
                tree = ast.parse(path.read_text())
            except SyntaxError:  # a harness test's deliberately broken example
                continue
            for node in ast.walk(tree):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                         else [])
                found[folder] |= {name.split(".")[0] for name in names} & {*PACKAGES, "tasks"} - {folder}
    return found


def test_imports_between_the_projects_folders_have_no_cycle():
    """The harness stands alone; the matrix and the commands build on it; pages' hooks, benchmarks
    and tests on them: no folder imports one that imports it back."""
    graph = imports_between_folders()
    assert graph["rankrun"] == set(), graph["rankrun"]
    assert "versions" in graph["hooks"] and "devtasks" in graph["benchmarks"]  # the walk sees imports

    def reaches(start, goal, seen=()):
        return any(step == goal or (step not in seen and reaches(step, goal, (*seen, step)))
                   for step in graph.get(start, ()))

    cycles = [folder for folder in PACKAGES if reaches(folder, folder)]
    assert not cycles, {folder: graph[folder] for folder in cycles}
