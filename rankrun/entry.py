"""The entry point of a snippet: the function its `if __name__ == "__main__":` block calls.

A run that calls `main` and a run of the file as `__main__` are one run when the file's main
block is just `main()`, or `main()` then the examples' ENDING: the rank runs the file as
`__main__` (exactly as `python file.py`) and keeps what that call returned. Standard library
only: the rank process imports it first.
"""

from __future__ import annotations

import ast
from pathlib import Path

RETURNED = "__rankrun_returned__"

# How an example whose ranks do collectives ends, after its main block's call (docs/versions.md,
# "An abort at exit"): gloo's threads can outlive destroy_process_group(), and one that gives
# back its last work while Python shuts down aborts the process; os._exit skips the shutdown.
ENDING = ("sys.stdout.flush()", "os._exit(0)")


def _ends_without_shutdown(statements: list[ast.stmt]) -> bool:
    """The last two statements are `sys.stdout.flush()` and `os._exit(...)`."""
    if len(statements) < 2:
        return False
    flush, leave = statements[-2:]
    return (ast.unparse(flush) == ENDING[0] and isinstance(leave, ast.Expr) and isinstance(leave.value, ast.Call)
            and ast.unparse(leave.value.func) == "os._exit")


def main_block(tree: ast.Module) -> ast.If | None:
    """The file's `if __name__ == "__main__":` block, or None."""
    return next((node for node in tree.body if _is_main_guard(node)), None)


def ends_without_shutdown(path: Path) -> bool:
    """Whether the file's main block ends with the examples' ending (ENDING, any exit code)."""
    block = main_block(ast.parse(Path(path).read_text(), str(path)))
    return block is not None and _ends_without_shutdown(block.body)


def _is_main_guard(node: ast.stmt) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and not node.orelse and isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def _guarded_call(tree: ast.Module) -> tuple[ast.If, str] | None:
    for node in tree.body:
        if not _is_main_guard(node):
            continue
        ending = [ast.unparse(statement) for statement in node.body[1:]]
        if ending in ([], list(ENDING)) and isinstance(node.body[0], ast.Expr):
            call = node.body[0].value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args and not call.keywords:
                return node, call.func.id
    return None


def guarded_function(path: Path) -> str | None:
    """The name of the function the file's main block calls with no arguments, or None."""
    try:
        found = _guarded_call(ast.parse(Path(path).read_text(), str(path)))
    except SyntaxError:
        return None
    return found[1] if found else None


def main_code_keeping(path: Path, function: str):
    """The file compiled as `python file.py` runs it, except that the main block's call of
    `function` stores what it returns in RETURNED; None if the main block calls something else.
    Line numbers and the file name are the file's, so tracebacks and coverage read the same."""
    source = Path(path).read_text()
    tree = ast.parse(source, str(path))
    found = _guarded_call(tree)
    if not found or found[1] != function:
        return None
    guard, _ = found
    call = guard.body[0]
    keep = ast.Assign(targets=[ast.Name(id=RETURNED, ctx=ast.Store())], value=call.value)
    guard.body[0] = ast.copy_location(keep, call)
    ast.fix_missing_locations(tree)
    return compile(tree, str(path), "exec")
