"""Benchmark: the authoring loop. Prints five figures against their targets (issue: fast authoring loop).

    .venv/bin/python benchmarks/authoring.py [--repeat 3] [--skip-suite] [--durations 15]

1. serve reload: `mkdocs serve` is running; a Markdown page changes (a paragraph is appended to
   docs/zero3/troubleshooting.md); seconds until the served page has the new text.
   Target <= 2 s. Runs on a copy of the project (so the checkout is never edited) that has the
   checkout's notebook cache, as an author's checkout has it after one build.
2. warm build: `mkdocs build` with nothing changed since the last build. Target <= 5 s.
3. strict build: `mkdocs build --strict` with NOTEBOOKS_EXECUTE=always, as CI and the test
   suite build: the notebook runs for real. No target; it bounds the suite.
4. full suite: `python3 tasks.py test` as tasks.py runs it (browser tests included). Target < 60 s.
5. quick suite: `python3 tasks.py test --quick`. Target < 30 s.

Each figure is wall-clock seconds (median of --repeat runs for 1 and 2), next to the CPU
seconds the processes used: on a shared, loaded machine the wall time grows with the load and
the CPU time much less, so the load average is printed before and after. For the suites the
slowest tests (pytest --durations) are printed, to say where the time goes. Not part of the
test suite: timings belong here, not in asserts.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from devtasks.child_env import environment
from devtasks.suite import pytest_arguments
from rankrun.project import free_port

PYTHON = sys.executable
PAGE = Path("docs") / "zero3" / "troubleshooting.md"
PAGE_URL = "zero3/troubleshooting/"
# Copied for the serve benchmark besides every file git tracks: the notebook cache an author's
# checkout has after one build, and the vendored scripts `tasks.py install` fetches.
UNTRACKED = [".cache/notebooks", "docs/assets/vendor"]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall seconds, CPU seconds of the process and its children, and the finished process."""
    cpu, started = children_cpu(), time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - started, children_cpu() - cpu, done


def fetch(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return ""


def serve_reload(repeat: int) -> list[float]:
    """Seconds from a Markdown edit to the served page showing it, `repeat` times."""
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        copy = Path(tmp) / "project"
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.splitlines()
        for name in [*tracked, *UNTRACKED]:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
            elif source.is_file():
                (copy / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, copy / name)
        port = free_port()
        log = open(Path(tmp) / "serve.log", "w")
        server = subprocess.Popen([PYTHON, "-m", "mkdocs", "serve", "--dev-addr", f"127.0.0.1:{port}"],
                                  cwd=copy, env=environment(), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        url = f"http://127.0.0.1:{port}/{PAGE_URL}"
        try:
            deadline = time.monotonic() + 600
            while "Troubleshooting" not in fetch(url):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"mkdocs serve did not come up:\n{(Path(tmp) / 'serve.log').read_text()[-3000:]}")
                time.sleep(0.2)
            page, seconds = copy / PAGE, []
            for n in range(repeat):
                time.sleep(1.0)  # let the server settle after its last build
                marker = f"benchmark-edit-{n}-{time.time_ns()}"
                started = time.perf_counter()
                page.write_text(page.read_text() + f"\n{marker}\n")
                while marker not in fetch(url):
                    if time.perf_counter() - started > 300:
                        raise SystemExit(f"the edit did not show within 300 s:\n{(Path(tmp) / 'serve.log').read_text()[-3000:]}")
                    time.sleep(0.05)
                seconds.append(time.perf_counter() - started)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, 15)
            server.wait()
            log.close()
    return seconds


def build(strict: bool, site: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    env = environment()
    command = [PYTHON, "-m", "mkdocs", "build", "--site-dir", str(site)]
    if strict:
        env["NOTEBOOKS_EXECUTE"] = "always"
        command.append("--strict")
    return timed(command, ROOT, env)


def suite(options: list[str], durations: int) -> tuple[float, float, str, list[str]]:
    """Wall and CPU seconds of the suite run as `python3 tasks.py test [options]` runs it, its
    summary line, and the slowest tests."""
    command = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--durations={durations}",
               *pytest_arguments(options)]
    wall, cpu, done = timed(command, ROOT, environment())
    lines = done.stdout.strip().splitlines()
    start = next((i for i, line in enumerate(lines) if "slowest" in line and "durations" in line), None)
    slowest = [line for line in lines[start + 1:] if "s " in line and "::" in line] if start is not None else []
    return wall, cpu, (lines[-1].strip("= ") if lines else "(no output)"), slowest


class Rows(list):
    """The figures; each is also printed as soon as it is measured (a long suite may not finish)."""

    def append(self, row):
        super().append(row)
        print("measured:", row[0], f"{row[1]:.2f} s wall", row[4], flush=True)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="edits and warm builds to take the median of")
    parser.add_argument("--skip-suite", action="store_true", help="leave out the two suite figures")
    parser.add_argument("--durations", type=int, default=15, help="slowest tests to list per suite")
    parser.add_argument("--suites-only", action="store_true", help="only the two suite figures")
    args = parser.parse_args()
    print(f"load average before: {load()} (on {os.cpu_count()} cores)", flush=True)
    rows = Rows()

    if args.suites_only:
        return suites_and_report(args, rows)
    reloads = serve_reload(args.repeat)
    rows.append(("serve reload after a Markdown edit", statistics.median(reloads), None, 2.0,
                 "median of " + ", ".join(f"{s:.2f}" for s in reloads)))

    with tempfile.TemporaryDirectory(prefix="bench-site-") as site:
        wall, cpu, done = build(strict=False, site=Path(site))  # warms the cache if it is cold
        if done.returncode != 0:
            raise SystemExit(f"the build failed:\n{done.stderr[-3000:]}")
        warm = [build(strict=False, site=Path(site)) for _ in range(args.repeat)]
        assert all("reusing the run" in done.stderr for _, _, done in warm), warm[0][2].stderr
        rows.append(("warm build (nothing changed)", statistics.median(w for w, _, _ in warm),
                     statistics.median(c for _, c, _ in warm), 5.0, f"median of {args.repeat}"))
        wall, cpu, done = build(strict=True, site=Path(site))
        if done.returncode != 0:
            raise SystemExit(f"the strict build failed:\n{done.stderr[-3000:]}")
        executed = next((line.split(": ", 1)[1] for line in done.stderr.splitlines() if "executed in" in line), "?")
        rows.append(("strict build (notebook executed)", wall, cpu, None, executed))

    return suites_and_report(args, rows)


def suites_and_report(args, rows) -> int:
    slowest = {}
    if not args.skip_suite:
        for name, options, target in [("full suite (tasks.py test)", [], 60.0),
                                      ("quick suite (tasks.py test --quick)", ["--quick"], 30.0)]:
            wall, cpu, summary, slowest[name] = suite(options, args.durations)
            rows.append((name, wall, cpu, target, summary))

    print(f"load average after: {load()}\n")
    width = max(len(row[0]) for row in rows)
    print(f"{'measure'.ljust(width)}  {'wall':>8}  {'cpu':>8}  {'target':>8}  met  note")
    for name, wall, cpu, target, note in rows:
        cpu_text = f"{cpu:.1f} s" if cpu is not None else "-"
        target_text = f"{target:.0f} s" if target else "-"
        met = "-" if not target else ("yes" if wall <= target else "NO")
        print(f"{name.ljust(width)}  {wall:>6.2f} s  {cpu_text:>8}  {target_text:>8}  {met:>3}  {note}")
    for name, lines in slowest.items():
        print(f"\nslowest tests, {name}:")
        for line in lines:
            print("  " + line.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
