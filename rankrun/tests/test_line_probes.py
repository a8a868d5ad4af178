"""The line probes of the snippet-coverage gate (rankrun.line_probes) record what coverage.py's
line tracer records, and change nothing else a file does: every statement coverage.py counts in
every file under snippets/ is a line a probe records; a file of every construct the probes handle
(decorators, a raising decorator, elif, loops with else and break, except clauses matched and
tested without a match, a bare except, finally, with, generators, comprehensions, lambdas, a dead
function) records exactly the lines coverage.py's tracer records, prints the same and shows the
same traceback; a sibling module is measured when imported, also from a .pyc, and no .pyc is
written with probes in it; the script of a rank that torchrun started (`python script.py`, which
the interpreter compiles itself) is measured too, and prints, fails and exits as without probes."""

import ast
import json
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import coverage

from rankrun import line_probes, torchrun_coverage
from rankrun.project import ROOT, SNIPPETS
from rankrun.runner import STACKS_AT_ABORT

CASES = Path(__file__).resolve().parent / "cases"
CONSTRUCTS = CASES / "line_probe_constructs.py"

# Run under coverage.py's tracer, under the probes, or plainly, in a process of its own (the probes
# replace `compile` and the import system's loader for the rest of a process's life).
RUN = '''
import json, os, runpy, sys
how, root, path = sys.argv[1:4]
if how == "coverage":
    import coverage
    measured = coverage.Coverage(data_file=None, config_file=False, include=[os.path.join(root, "*")])
    measured.start()
elif how == "probes":
    from rankrun import line_probes
    line_probes.start(root)
sys.path[0] = os.path.dirname(path)  # as `python path` has it
runpy.run_path(path, run_name="__main__")
sys.stdout.flush()
if how == "coverage":
    measured.stop()
    data = measured.get_data()
    lines = {name: sorted(data.lines(name)) for name in data.measured_files()}
elif how == "probes":
    lines = line_probes.lines()
else:
    lines = {}
print("LINES " + json.dumps(lines))
'''


def run(how: str, root: Path, path: Path) -> tuple[str, dict[str, list[int]]]:
    done = subprocess.run([sys.executable, "-c", RUN, how, str(root), str(path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    printed, _, lines = done.stdout.rpartition("LINES ")
    return printed, json.loads(lines)


def statements(path: Path) -> set[int]:
    """coverage.py's statements of a file, before any exclusion."""
    _, lines, _, _, _ = coverage.Coverage(data_file=None, config_file=False).analysis2(str(path))
    return set(lines)


def test_every_statement_of_every_snippet_is_a_line_a_probe_records():
    files = sorted(SNIPPETS.rglob("*.py"))
    assert len(files) > 50
    for path in files:
        tree, _ = line_probes.instrument(ast.parse(path.read_text(), str(path)), str(path.resolve()))
        compile(tree, str(path), "exec")
        assert statements(path) <= line_probes.probed_lines(path), path


# The statements of CONSTRUCTS that never run: an else branch, a loop's else after a break, a branch
# not taken, an except clause never tested and its body, the body of one tested without a match
# (`except OSError:` itself ran), what follows a return inside a with, and an early return, a dead
# function, the def under a decorator that raised and what follows it.
NEVER_RUN = ['return "many"', "total += 1000", "raise TypeError(kind)", "except ZeroDivisionError:",
             'result = "never"', "pass", "return x", "y = 2; z = 3", "return y + z", 'return "dead"',
             "def inner():", "return 1", "return inner"]


def test_the_probes_record_what_coverage_records_and_change_nothing_else(tmp_path):
    root = tmp_path / "snippets"
    root.mkdir()
    path = root / CONSTRUCTS.name
    shutil.copy(CONSTRUCTS, path)
    traced_output, traced = run("coverage", root, path)
    probed_output, probed = run("probes", root, path)
    plain_output, _ = run("plain", root, path)
    file = str(path.resolve())
    executed = set(traced[file]) & statements(path)
    assert set(probed[file]) & statements(path) == executed
    # The file has lines that never run, of each kind: a branch, a loop's else after break, an
    # except clause whose body never runs, a dead function, what follows a raising decorator.
    never = sorted(statements(path) - executed)
    source = path.read_text().splitlines()
    assert [source[line - 1].strip() for line in never] == NEVER_RUN, never
    assert plain_output == probed_output == traced_output
    # the traceback in it: the same file, lines, source lines and column markers
    assert "KeyError: 'absent'" in plain_output and "+ values[\n" in plain_output and "^^^" in plain_output


def test_a_sibling_module_is_measured_also_from_a_pyc_and_no_pyc_is_written(tmp_path):
    root = tmp_path / "snippets"
    root.mkdir()
    (root / "helper.py").write_text("def double(x):\n    return 2 * x\n\n\ndef unused():\n    return 0\n")
    (root / "main.py").write_text("from helper import double\n\nprint(double(2))\n")
    compiled = Path(py_compile.compile(str(root / "helper.py")))
    before = compiled.read_bytes()
    printed, lines = run("probes", root, root / "main.py")
    assert printed == "4\n"
    assert lines == {str((root / "helper.py").resolve()): [1, 2, 5], str((root / "main.py").resolve()): [1, 3]}
    assert compiled.read_bytes() == before and os.listdir(compiled.parent) == [compiled.name]


RAISES = """import pickle
import sys


class Kept:
    pass


def main():
    print(__name__, __file__, sys.path[0] == __file__.rsplit("/", 1)[0])
    print(type(pickle.loads(pickle.dumps(Kept()))).__module__)
    raise ValueError("the script's own failure")


if __name__ == "__main__":
    main()
"""


def test_the_script_of_a_torchrun_rank_is_measured_and_runs_as_without_probes(tmp_path):
    """torchrun starts each rank as `python -u script.py`: the interpreter compiles that file
    itself, so torchrun_coverage's sitecustomize runs it with the probes (line_probes.run_script)."""
    root = tmp_path / "snippets"
    root.mkdir()
    shutil.copy(CONSTRUCTS, root / CONSTRUCTS.name)
    (root / "raises.py").write_text(RAISES)
    data = tmp_path / "coverage"
    data.mkdir()
    # as rankrun.runner.run_torchrun has it: the stacks-at-abort sitecustomize, then coverage's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STACKS_AT_ABORT), str(ROOT)])}
    env.update(torchrun_coverage.environment(env))
    rank = {**env, "RANKRUN_SNIPPETS": str(root), "SNIPPET_COVERAGE_DATA": str(data / "data"),
            "TORCHELASTIC_RUN_ID": "run", "RANK": "0"}
    _, probed = run("probes", root, root / CONSTRUCTS.name)
    for name in (CONSTRUCTS.name, "raises.py"):
        command = [sys.executable, "-u", f"snippets/{name}"]
        plain = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        measured = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=rank)
        assert (measured.returncode, measured.stdout, measured.stderr) == (
            plain.returncode, plain.stdout, plain.stderr)
    assert plain.returncode == 1 and plain.stdout.splitlines()[1] == "__main__", plain.stdout
    assert plain.stderr.endswith("ValueError: the script's own failure\n"), plain.stderr
    seen = {}
    for written in (data / "seen").glob("*.json"):
        seen.update(json.loads(written.read_text()))
    constructs, raises = str((root / CONSTRUCTS.name).resolve()), str((root / "raises.py").resolve())
    assert seen[constructs] == probed[constructs]
    assert seen[raises] == [1, 2, 5, 6, 9, 10, 11, 12, 15, 16]
