"""Which lines of the snippet files a rank ran, without a tracer: each snippet file is compiled
with a probe before each statement (rankrun.snippet_coverage's gate reads what they record).

Why not coverage.py's tracer: on Python 3.11 (no sys.monitoring) any trace function makes the
interpreter run every instruction of every frame in its tracing mode, torch's and DeepSpeed's
too, and a frame object for every call; a traced rank of a short example used 30 to 60% more CPU,
nearly all of it in library code that the gate does not measure. A probe costs one call of a C
function (`set.add`) per statement of a snippet that runs, and nothing elsewhere.

A probe records what coverage.py's line tracer would see, statement by statement:

- a statement: its first line, just before its first instruction runs;
- a decorator: its line before its expression is evaluated, and the line of the `def` or `class`
  it decorates once the last decorator expression was evaluated (the definition comes next);
- an `except T:` clause: its line when the clause is tested (`T` is evaluated), matched or not;
  a bare `except:`, when its body is entered;
- a `case` of a `match`: when its body is entered (coverage.py also sees a case that was tested
  and did not match: here such a line counts as not run, which can only fail the gate, never pass it);
- a module's docstring and `from __future__` imports, with the first probe after them (they
  cannot fail, and nothing may come before them).

Every line coverage.py counts as a statement of a snippet is a line some probe records
(rankrun/tests/test_line_probes.py checks it for every file under snippets/, and that a file of
every construct above records the same lines as coverage.py's tracer).

The probes are compiled in wherever a snippet file becomes code in a measured rank: `compile`
(runpy, `exec(compile(...))`, the harness's own entry point) and the import system (a sibling
snippet module, also when a `.pyc` of it exists). The one file the interpreter compiles itself,
the script of `python script.py` (a rank torchrun started), is run by `run_script` instead. Line numbers, columns, file names and the
source that tracebacks and `inspect` read stay the file's own.
"""

from __future__ import annotations

import ast
import builtins
import importlib.machinery
import os
from pathlib import Path

PROBE = "__rankrun_line__"  # in builtins while measuring: `set.add` of the codes below
# A probe's argument: FILE_STRIDE * (the file's index) + line.
FILE_STRIDE = 1 << 20

_files: list[str] = []  # index -> absolute path
_index: dict[str, int] = {}
_codes: set[int] = set()
_roots: tuple[str, ...] = ()  # the measured directory, as given and resolved, each ending in "/"
_real_compile = builtins.compile
_real_get_code = importlib.machinery.SourceFileLoader.get_code


def _code(path: str, line: int) -> int:
    index = _index.get(path)
    if index is None:
        index = _index[path] = len(_files)
        _files.append(path)
    return index * FILE_STRIDE + line


def _probe(code: int, node: ast.AST) -> ast.stmt:
    call = ast.Expr(ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(code)], []))
    return ast.copy_location(call, node)


def _seen_then(code: int, value: ast.expr) -> ast.expr:
    """`__rankrun_line__(code) or value`: records, then evaluates `value` (set.add returns None)."""
    probe = ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(code)], [])
    return ast.copy_location(ast.BoolOp(ast.Or(), [ast.copy_location(probe, value), value]), value)


def _value_then_seen(value: ast.expr, code: int) -> ast.expr:
    """`(value, __rankrun_line__(code))[0]`: evaluates `value`, then records."""
    probe = ast.copy_location(ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(code)], []), value)
    pair = ast.copy_location(ast.Tuple([value, probe], ast.Load()), value)
    return ast.copy_location(ast.Subscript(pair, ast.Constant(0), ast.Load()), value)


BODIES = ("body", "orelse", "finalbody")


class _Probes:
    def __init__(self, path: str):
        self.path = path
        self.lines: set[int] = set()  # every line a probe records

    def code(self, line: int) -> int:
        self.lines.add(line)
        return _code(self.path, line)

    def module(self, tree: ast.Module) -> ast.Module:
        body = tree.body
        head = 0
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            head = 1
        while head < len(body) and isinstance(body[head], ast.ImportFrom) and body[head].module == "__future__":
            head += 1
        rest = self.block(body[head:])
        # The docstring and the future imports, recorded right after them.
        recorded = [self.code(node.lineno) for node in body[:head]]
        tree.body = body[:head] + [_probe(code, body[0]) for code in recorded] + rest
        return tree

    def block(self, statements: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for node in statements:
            self.inside(node)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.decorator_list:
                self.decorated(node)
            else:
                out.append(_probe(self.code(node.lineno), node))
            out.append(node)
        return out

    def decorated(self, node) -> None:
        decorators = [_seen_then(self.code(expr.lineno), expr) for expr in node.decorator_list]
        decorators[-1] = _value_then_seen(decorators[-1], self.code(node.lineno))
        node.decorator_list = decorators

    def inside(self, node: ast.stmt) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            docstring = bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str)
            node.body = body[:1] + self.block(body[1:]) if docstring else self.block(body)
            return
        for field in BODIES:
            statements = getattr(node, field, None)
            if isinstance(statements, list) and statements:
                setattr(node, field, self.block(statements))
        for handler in getattr(node, "handlers", ()):
            if handler.type is not None:
                handler.type = _seen_then(self.code(handler.lineno), handler.type)
                handler.body = self.block(handler.body)
            else:
                handler.body = [_probe(self.code(handler.lineno), handler)] + self.block(handler.body)
        for case in getattr(node, "cases", ()):
            case.body = [_probe(self.code(case.pattern.lineno), case.pattern)] + self.block(case.body)


def instrument(tree: ast.Module, path: str) -> tuple[ast.Module, set[int]]:
    """`tree` (the file's, parsed) with its probes, and every line a probe can record."""
    probes = _Probes(path)
    tree = probes.module(tree)
    ast.fix_missing_locations(tree)
    return tree, probes.lines


def _measured(filename) -> str | None:
    """The resolved path of `filename` if it is a file the probes measure, else None (the gate
    names files by their resolved paths, as coverage.py does)."""
    if not _roots or not isinstance(filename, (str, os.PathLike)):
        return None
    path = os.path.abspath(os.fspath(filename))
    if not path.endswith(".py") or not path.startswith(_roots):
        return None
    path = os.path.realpath(path)
    return path if path.startswith(_roots) else None


def _compile(source, filename, mode, flags=0, dont_inherit=False, optimize=-1, **kwargs):
    path = _measured(filename) if mode == "exec" and not flags & ast.PyCF_ONLY_AST else None
    if path is not None:
        tree = source if isinstance(source, ast.Module) else _real_compile(
            source, filename, mode, flags | ast.PyCF_ONLY_AST, dont_inherit, optimize, **kwargs)
        source, _ = instrument(tree, path)
    return _real_compile(source, filename, mode, flags, dont_inherit, optimize, **kwargs)


def _get_code(self, fullname):
    path = _measured(self.get_filename(fullname))
    if path is None:
        return _real_get_code(self, fullname)
    # From the source, never a .pyc: the probes are compiled in (and no .pyc is written with them).
    return self.source_to_code(self.get_data(path), path)


def start(root: str | os.PathLike) -> None:
    """Record the statements run from now on in the .py files under `root` (compiled from now on)."""
    global _roots
    _roots = tuple({os.path.join(os.path.abspath(root), ""), os.path.join(os.path.realpath(root), "")})
    setattr(builtins, PROBE, _codes.add)
    builtins.compile = _compile
    importlib.machinery.SourceFileLoader.get_code = _get_code


def measured_script() -> str | None:
    """The script this interpreter was started with (`python script.py`), if it is a file the
    probes measure. The interpreter compiles that file itself, with no `compile` call or import
    that a probe could be compiled into: run_script runs it instead."""
    import sys

    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    return _measured(script) if script else None


def run_script(path: str) -> None:
    """Run the script the interpreter was started with, compiled with probes, in `__main__` as the
    interpreter would run it, then end the process with its exit status (rankrun.torchrun_coverage
    calls it at the end of its sitecustomize, once the site is set up)."""
    import __main__
    import atexit
    import sys

    script = os.path.abspath(sys.argv[0])  # as the interpreter names it (__file__, tracebacks)
    sys.path.insert(0, os.path.dirname(path))  # the script's directory, symbolic links resolved
    __main__.__file__ = script
    __main__.__cached__ = None
    __main__.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    status = 0
    try:
        with open(script, "rb") as source:
            code = compile(source.read(), script, "exec")  # _compile: with the probes
        exec(code, __main__.__dict__)
    except SystemExit as stop:
        if stop.code is None:
            status = 0
        elif isinstance(stop.code, int):
            status = stop.code
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException as error:  # as the interpreter reports it, without this function's frame
        error = error.with_traceback(error.__traceback__.tb_next)
        sys.excepthook(type(error), error, error.__traceback__)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status)


def lines() -> dict[str, list[int]]:
    """{file: sorted line numbers} recorded so far, as rankrun.snippet_coverage.record_seen takes them."""
    found: dict[str, set[int]] = {}
    for code in list(_codes):
        found.setdefault(_files[code // FILE_STRIDE], set()).add(code % FILE_STRIDE)
    return {path: sorted(numbers) for path, numbers in found.items()}


def probed_lines(path: str | os.PathLike) -> set[int]:
    """Every line a probe of this file can record (for the check against coverage.py's statements)."""
    path = str(Path(path).resolve())
    _, found = instrument(ast.parse(Path(path).read_text(), path), path)
    return found
