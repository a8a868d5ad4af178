"""One rank process of a snippet run: started by `tests/runner.py`, never imported.

    python tests/rank_main.py SNIPPET REPORT_FILE [FUNCTION]

Runs SNIPPET as `__main__` (exactly as `python SNIPPET` would), or, with
FUNCTION, loads it as a module and calls that function with no arguments.
Writes a pickled report (exception details, the function's return value) to
REPORT_FILE and exits 0 on success, 1 when the snippet raised.
"""

import os
import pickle
import runpy
import sys
import traceback


def describe(error: BaseException) -> dict:
    kind = type(error)
    return {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "name": kind.__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(error)),
    }


def main() -> int:
    snippet, report_file = sys.argv[1], sys.argv[2]
    function = sys.argv[3] if len(sys.argv) > 3 else ""
    # Look like `python SNIPPET`: argv and the import path start at the snippet.
    sys.argv = [snippet]
    sys.path[0] = os.path.dirname(os.path.abspath(snippet))
    report = {"exception": None, "returned": None}
    exit_code = 0
    try:
        if function:
            namespace = runpy.run_path(snippet, run_name="__snippet__")
            report["returned"] = namespace[function]()
        else:
            runpy.run_path(snippet, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            report["exception"] = describe(stop)
            exit_code = stop.code if isinstance(stop.code, int) else 1
    except BaseException as error:  # noqa: BLE001 - the report is the point
        report["exception"] = describe(error)
        traceback.print_exc()
        exit_code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            payload = pickle.dumps(report)
        except Exception as error:  # an unpicklable return value is a failure too
            report = {"exception": describe(error), "returned": None}
            payload = pickle.dumps(report)
            exit_code = exit_code or 1
        with open(report_file, "wb") as handle:
            handle.write(payload)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
