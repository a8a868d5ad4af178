"""What a CPython release does to a native thread that takes the GIL while Python shuts down.

    python3 benchmarks/gil_at_finalization.py [PYTHON ...]   # default: python3.11, 3.12, 3.13 on PATH

The abort at exit of docs/versions.md without torch: gil_at_finalization/late_gil.cpp starts a
C++ thread whose noexcept destructor takes the GIL (as a gloo worker destroying its last work
does, through pybind11's gil_scoped_acquire); finalizing.py lets the interpreter shut down
while that thread waits. Builds the extension for each interpreter given (g++ and the
interpreter's headers) and runs it three times: CPython up to 3.13.0 exits that thread with
pthread_exit, whose forced unwind through the noexcept destructor calls std::terminate
(`terminate called without an active exception`, killed by SIGABRT: -6); CPython 3.14 hangs the
thread instead (python/cpython gh-87135; read from source, not run here: no 3.14 here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent / "gil_at_finalization"


def run_on(python: str) -> None:
    asked = subprocess.run([python, "-c", "import sys, sysconfig; print(sys.version.split()[0]); "
                            "print(sysconfig.get_paths()['include']); print(sysconfig.get_config_var('EXT_SUFFIX'))"],
                           capture_output=True, text=True)
    if asked.returncode != 0:
        print(f"{python}: does not run here ({asked.stderr.strip().splitlines()[-1:]})")
        return
    version, include, suffix = asked.stdout.split("\n")[:3]
    with tempfile.TemporaryDirectory() as build:
        subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-pthread", f"-I{include}", str(HERE / "late_gil.cpp"),
                        "-o", str(Path(build) / f"late_gil{suffix}")], check=True)
        for attempt in range(3):
            done = subprocess.run([python, str(HERE / "finalizing.py")], env={**os.environ, "PYTHONPATH": build},
                                  capture_output=True, text=True, timeout=60)
            said = (done.stdout + done.stderr).strip().replace("\n", " | ")
            print(f"Python {version}, run {attempt + 1}: exit status {done.returncode}: {said}", flush=True)


def main() -> int:
    pythons = sys.argv[1:] or [name for name in ("python3.11", "python3.12", "python3.13") if shutil.which(name)]
    for python in pythons:
        run_on(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
