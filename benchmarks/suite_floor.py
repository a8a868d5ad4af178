"""Benchmark: the suite's floor and where its time goes. Every figure is printed with its target,
wall-clock and CPU seconds, and the load average before and after it: on a shared, loaded machine
the wall time grows with the load and the CPU time much less. Not part of the test suite: timings
belong here, never in a timed test.

    .venv/bin/python benchmarks/suite_floor.py --only startup       # fixed start-up costs
    .venv/bin/python benchmarks/suite_floor.py --only changed       # the edit loop
    .venv/bin/python benchmarks/suite_floor.py --only suite         # whole suite, 20 slowest by cause
    .venv/bin/python benchmarks/suite_floor.py --only second-pass   # .ci/run's ATEN_CPU_CAPABILITY=default pass
    .venv/bin/python benchmarks/suite_floor.py                      # all four, in that order

1. Start-up, the fixed costs every command pays before a test runs: the environment check of
   `tasks.py`, collecting the whole suite, the page reader (every include and output block of
   every page), the warm zygote's imports (with and without Transformers), and the strict build
   (the notebook's cached run reused, and executed).
2. `python3 tasks.py test --changed` after a page-only edit (a blank line appended to --page)
   and after a snippet edit (a comment appended to --snippet), each run twice (the first run
   after the edit, then the same command again); the files are restored afterwards. Targets:
   <= 20 s for the page, <= 25 s plus the snippet's own runs (the wall time of the runs it made,
   from the harness's request log) for the snippet. Needs a clean working tree.
3. The whole suite, `python3 tasks.py test --durations=0`, as CI runs it after the install:
   pytest's wall time, the harness's run summary (every distinct run made once), the 20
   slowest tests grouped by cause: waiting (for a timeout, a hang, or another worker's run),
   training (runs in the warm pool), interpreters (fresh ranks, real torchrun, new Python
   processes), builds (the site), browser; and the suite's CPU by where it goes (the plugin
   benchmarks/cpu_split.py, loaded into the session): runs in the warm pool, fresh interpreters
   (documented torchrun commands, fresh=True runs, the harness's cases), nested pytest or
   tasks.py sessions, site builds and the browser, collection, the tests' own work in their
   processes, and the warm zygotes' imports; then the share that is not the examples' own work.
   `--checkout PATH` measures another checkout (say, main before a change) with this benchmark's
   plugin: today's figure first, then the change's.
4. `.ci/run`'s second pass: the tests that compare numbers, under ATEN_CPU_CAPABILITY=default.
   The fresh-clone `.ci/run` (target <= 12 min) is this pass + the suite + the install (about
   160 s on 2 idle cores): not run here, since it reinstalls everything.

Do not run 3 or 4 on a machine that others load: they take every core for minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from devtasks.checkout import PYTHON
from devtasks.child_env import environment  # the environment tasks.py gives what it runs

ROOT = Path(__file__).resolve().parent.parent
# What tasks.py gives its children (DS_ACCELERATOR, TORCH_EXTENSIONS_DIR, .venv/bin first on PATH):
# a build run with another `ninja` first on PATH would rebuild DeepSpeed's op (docs/testing.md).
ENVIRONMENT = environment()
SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed).*?) in ([\d.]+)s", re.M)
RUNS = re.compile(r"^rankrun: .*$", re.M)
DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S.*?)\s*$", re.M)
CAUSES = ("waiting", "training", "interpreters", "builds", "browser", "other")


def load() -> str:
    return "load average " + ", ".join(f"{value:.2f}" for value in os.getloadavg())


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], env: dict | None = None) -> tuple[float, float, subprocess.CompletedProcess]:
    cpu, start = children_cpu(), time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**ENVIRONMENT, **(env or {})})
    return time.monotonic() - start, children_cpu() - cpu, done


def figure(name: str, wall: float, cpu: float, before: str, target: float | None = None, note: str = "") -> None:
    verdict = "" if target is None else f"; target <= {target:.0f} s: {'meets' if wall <= target else 'misses'}"
    print(f"{name}: {wall:.1f} s wall, {cpu:.1f} s CPU{verdict}{note}")
    print(f"  {before} before, {load()} after")


def failed(done: subprocess.CompletedProcess) -> None:
    if done.returncode:
        print(f"  exit {done.returncode}; last lines:\n    "
              + "\n    ".join((done.stdout + done.stderr).strip().splitlines()[-15:]))


# --- 1. start-up ---------------------------------------------------------------------------

IN_PROCESS = {
    "the page reader: every include and output block of every page": (
        "from rankrun import pages\n"
        "pages.includes()\n"
        "[pages.output_blocks(pages.page_lines(page)) for page in pages.doc_pages()]\n"),
    "the warm zygote's imports (rank_main.WARM_IMPORTS)": (
        "from rankrun import rank_main; rank_main.warm_up()\n"),
    "the warm zygote's imports without Transformers (a --changed run for a ZeRO-3 page)": (
        "import os\nfrom rankrun import rank_main\n"
        "os.environ['RANKRUN_WARM_IMPORTS'] = ','.join(n for n in rank_main.WARM_IMPORTS\n"
        "                                              if n not in rank_main.TRANSFORMERS_IMPORTS)\n"
        "rank_main.warm_up()\n"),
}


def startup() -> None:
    env: dict[str, str] = {}
    before = load()
    wall, cpu, done = timed([sys.executable, "tasks.py", "install"])
    figure("tasks.py's environment check (`tasks.py install` on a ready .venv)", wall, cpu, before)
    failed(done)
    before = load()
    wall, cpu, done = timed([str(PYTHON), "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "-n", "0"], env)
    count = re.search(r"^(\d+) tests? collected", done.stdout, re.M)
    figure(f"collecting the whole suite, one process ({count.group(1) if count else '?'} tests)", wall, cpu, before)
    failed(done)
    for name, code in IN_PROCESS.items():
        before = load()
        wall, cpu, done = timed([str(PYTHON), "-c", code], env)
        figure(name, wall, cpu, before)
        failed(done)
    with tempfile.TemporaryDirectory(prefix="suite-floor-site-") as site:
        build = [str(PYTHON), "-m", "mkdocs", "build", "--strict", "--site-dir", site]
        for how, execute in (("the notebook's run executed", "always"), ("the notebook's cached run reused", "auto")):
            before = load()
            wall, cpu, done = timed(build, {"NOTEBOOKS_EXECUTE": execute})
            reused = "reusing the run" in done.stderr
            figure(f"the strict build, {how}", wall, cpu, before, note=f" (reused: {reused})")
            failed(done)


# --- 2. the edit loop ----------------------------------------------------------------------

def requests(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def changed_loop(path: Path, edit: str, target: float, own_runs: bool) -> None:
    original = path.read_text()
    try:
        path.write_text(original + edit)
        for attempt in ("the first run after the edit", "the same command again"):
            with tempfile.TemporaryDirectory(prefix="suite-floor-") as tmp:
                log = Path(tmp) / "requests.jsonl"
                before = load()
                wall, cpu, done = timed([sys.executable, "tasks.py", "test", "--changed"],
                                        {"RANKRUN_KEEP_RUN_LOG": str(log)})
                made = [entry for entry in requests(log) if entry["made"]]
            runs_wall = sum(entry["wall"] for entry in made)
            summary = SUMMARY.search(done.stdout)
            note = f"; {summary.group(1) if summary else 'no summary'}; {len(made)} runs made ({runs_wall:.1f} s of their wall)"
            if own_runs:
                figure(f"tasks.py test --changed, {path.relative_to(ROOT)} edited, {attempt}", wall, cpu, before,
                       note=note)
                print(f"  without its runs: {wall - runs_wall:.1f} s; target <= {target:.0f} s plus its own runs: "
                      f"{'meets' if wall - runs_wall <= target else 'misses'}")
            else:
                figure(f"tasks.py test --changed, {path.relative_to(ROOT)} edited, {attempt}", wall, cpu, before,
                       target, note)
            runs = RUNS.search(done.stdout)
            if runs:
                print(f"  {runs.group(0)}")
            failed(done)
    finally:
        path.write_text(original)


# --- 3. the whole suite, and its slowest tests by cause ------------------------------------

def durations(stdout: str) -> dict[str, float]:
    """nodeid -> seconds of setup, call and teardown, from pytest's --durations=0 lines."""
    total: dict[str, float] = defaultdict(float)
    for seconds, _, nodeid in DURATION.findall(stdout):
        total[nodeid] += float(seconds)
    return dict(total)


def cause_of(nodeid: str, seconds: float, asked: list[dict]) -> tuple[str, Counter]:
    """What a test spent its time on: its requests to the run cache (each with its wall time),
    the rest by where the test lives."""
    spent: Counter = Counter()
    for entry in asked:
        key = json.loads(entry["key"])
        if not entry["made"] or entry.get("ended") in ("timed out", "hung"):
            spent["waiting"] += entry["wall"]  # for another worker's run, a timeout, or a hang
        elif key.get("kind") == "torchrun" or key.get("fresh"):
            spent["interpreters"] += entry["wall"]
        else:
            spent["training"] += entry["wall"]
    rest = max(0.0, seconds - sum(spent.values()))
    path = nodeid.split("::", 1)[0]
    if path.startswith(("tests/site/test_browser", "tests/site/test_jupyterlab")):
        spent["browser"] += rest
    elif path == "tests/test_site.py" or path.startswith("tests/site/"):
        spent["builds"] += rest
    elif path.startswith("tests/test_tasks_") or path in (
            "tests/test_plain_python.py", "tests/test_deepspeed_op_build.py",
            "rankrun/tests/test_kernel_independent.py") or "torchrun" in nodeid:
        spent["interpreters"] += rest
    else:
        spent["other"] += rest
    return max(spent, key=spent.get), spent


def slowest_by_cause(stdout: str, asked: list[dict], count: int = 20) -> None:
    by_test = defaultdict(list)
    for entry in asked:
        by_test[entry["test"]].append(entry)
    times = durations(stdout)
    slowest = sorted(times.items(), key=lambda item: -item[1])[:count]
    grouped: dict[str, list] = defaultdict(list)
    for nodeid, seconds in slowest:
        cause, spent = cause_of(nodeid, seconds, by_test.get(nodeid, []))
        grouped[cause].append((nodeid, seconds, spent))
    print(f"the {len(slowest)} slowest tests ({sum(s for _, s in slowest):.0f} s of {sum(times.values()):.0f} s "
          f"of test time), by cause:")
    for cause in CAUSES:
        if cause not in grouped:
            continue
        print(f"  {cause}: {sum(seconds for _, seconds, _ in grouped[cause]):.1f} s")
        for nodeid, seconds, spent in grouped[cause]:
            parts = ", ".join(f"{name} {value:.1f}" for name, value in spent.most_common() if value >= 0.1)
            print(f"    {seconds:7.1f} s  {nodeid}  ({parts})")


def whole_suite(command: list[str], name: str, target: float, env: dict | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="suite-floor-") as tmp:
        log = Path(tmp) / "requests.jsonl"
        split_log = Path(tmp) / "cpu.jsonl"
        before = load()
        # -v: each test's outcome as it ends, so an interrupted run still says which tests failed;
        # -p cpu_split: where the CPU goes (benchmarks/cpu_split.py, on PYTHONPATH)
        plugin_path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                    os.environ.get("PYTHONPATH")]))
        wall, cpu, done = timed(command + ["-v", "--durations=0", "-p", "cpu_split"],
                                {**(env or {}), "RANKRUN_KEEP_RUN_LOG": str(log), "CPU_SPLIT_LOG": str(split_log),
                                 "PYTHONPATH": plugin_path})
        asked = requests(log)
        kept_log = Path(tempfile.mkstemp(prefix="suite-floor-requests-", suffix=".jsonl")[1])
        kept_log.write_text(log.read_text() if log.exists() else "")
        split = requests(split_log)
    summary = SUMMARY.search(done.stdout)
    figure(name, wall, cpu, before, target, f"; pytest: {summary.group(1)} in {summary.group(2)} s" if summary else "")
    kept = Path(tempfile.mkstemp(prefix="suite-floor-output-", suffix=".txt")[1])
    kept.write_text(done.stdout + done.stderr)
    print(f"  pytest's whole output: {kept}; the run cache's requests (test, run, wall time): {kept_log}")
    runs = RUNS.search(done.stdout)
    if runs:
        print(f"  {runs.group(0)}")
    failed(done)
    slowest_by_cause(done.stdout, asked)
    cpu_by_where(split, asked, cpu, before)


# Test modules that start a pytest or tasks.py session of their own (each pays its collection, and
# a zygote of its own when it runs examples): found by what their source runs.
NESTED_SESSION = re.compile(r'"-m", *"pytest"|\[sys\.executable, *"tasks\.py"')
SITE_BUILDS = ("tests/test_site.py", "tests/site/test_notebook_cache.py", "tests/site/test_rebuild_cache.py",
               "tests/site/test_offline.py")
BROWSER = ("tests/site/test_browser.py", "tests/site/test_jupyterlab.py")
# What is the examples' own work: their runs in the warm pool, and the tests' comparisons of them
# in the test processes (the one-process references). The rest is what the suite pays around them.
OWN_WORK = ("runs in the warm pool", "the tests' own work in their processes")


def nested_modules() -> set[str]:
    found = set()
    for path in [*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "rankrun" / "tests").glob("test_*.py")]:
        if NESTED_SESSION.search(path.read_text()):
            found.add(str(path.relative_to(ROOT)))
    return found


def cpu_by_where(split: list[dict], asked: list[dict], total: float, before: str) -> None:
    """The suite's CPU by where it goes, from benchmarks/cpu_split.py's log (see the docstring)."""
    if not split:
        print("  no CPU split (benchmarks/cpu_split.py wrote nothing)")
        return
    nested, fresh_tests = nested_modules(), set()
    for entry in asked:
        key = json.loads(entry["key"])
        if key.get("kind") == "torchrun" or key.get("fresh") or not entry["cached"]:
            fresh_tests.add(entry["test"])
    where: Counter = Counter()
    in_tests: dict[int, float] = defaultdict(float)
    for entry in split:
        if entry["kind"] == "collection":
            where["collection"] += entry["cpu"]
        elif entry["kind"] == "test":
            nodeid, path = entry["nodeid"], entry["nodeid"].split("::", 1)[0]
            in_tests[entry["pid"]] += entry["children"]
            where["the tests' own work in their processes"] += entry["self"]
            if path in nested:
                where["nested pytest or tasks.py sessions"] += entry["children"]
            elif path in BROWSER:
                where["the browser"] += entry["children"]
            elif path in SITE_BUILDS or path == "tests/test_versions.py":
                where["site builds"] += entry["children"]
            elif nodeid in fresh_tests or path.startswith("rankrun/tests/") or path.startswith(
                    ("tests/test_plain_python", "tests/test_readme", "tests/test_deepspeed_op_build")):
                where["fresh interpreters (torchrun, fresh=True, the harness's cases)"] += entry["children"]
            else:
                where["other processes a test started and waited for"] += entry["children"]
    zygote_imports = zygote_import_cpu()
    processes = [entry for entry in split if entry["kind"] == "process"]
    workers_total = sum(entry["self"] + entry["children"] for entry in processes if entry["worker"])
    for entry in processes:
        collection = next((e["cpu"] for e in split if e["kind"] == "collection" and e["pid"] == entry["pid"]), 0.0)
        # the rest of the process's own CPU (hooks, the summary, xdist's messages)
        own = entry["self"] - collection - sum(e["self"] for e in split if e["kind"] == "test" and e["pid"] == entry["pid"])
        where["the test processes besides tests (hooks, xdist, the summary)"] += max(own, 0.0)
        warm = entry["children"] - in_tests[entry["pid"]]
        if entry["worker"] or not workers_total:
            # the zygote and every warm rank it forked, reaped when the session ended
            imports = min(zygote_imports, max(warm, 0.0))
            where["the warm zygotes' imports"] += imports
            where["runs in the warm pool"] += max(warm - imports, 0.0)
        else:
            # the main process of pytest-xdist: its children are the workers (counted above) and, when
            # the coverage gate made runs again at the end, its own zygote and those runs
            again = warm - workers_total
            if again > 1.0:
                imports = min(zygote_imports, again)
                where["the warm zygotes' imports"] += imports
                where["runs the coverage gate made again (main process)"] += again - imports
    rest = total - sum(where.values())
    if rest > 0:
        where["tasks.py, and what no test session process reaped"] += rest
    accounted = sum(where.values())
    print(f"where the suite's CPU went ({total:.0f} s of CPU in all; {before} before, {load()} after):")
    for name, seconds in where.most_common():
        print(f"  {seconds:8.1f} s  {100 * seconds / accounted:5.1f}%  {name}")
    overhead = sum(seconds for name, seconds in where.items() if name not in OWN_WORK)
    print(f"  not the examples' own work (all but {' and '.join(OWN_WORK)}): {overhead:.0f} s, "
          f"{100 * overhead / accounted:.1f}% of the suite's CPU")


def zygote_import_cpu() -> float:
    """CPU seconds of one warm zygote's imports (rank_main.warm_up), measured once here."""
    _, cpu, done = timed([str(PYTHON), "-c", IN_PROCESS["the warm zygote's imports (rank_main.WARM_IMPORTS)"]])
    return cpu if done.returncode == 0 else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["startup", "changed", "suite", "second-pass"])
    parser.add_argument("--page", type=Path, default=Path("docs/zero3/external-parameters.md"))
    parser.add_argument("--snippet", type=Path, default=Path("snippets/zero3/module_z3.py"))
    parser.add_argument("--checkout", type=Path, default=None,
                        help="measure the suite of another checkout of the project (its own .venv), e.g. main "
                             "before a change, with this benchmark's CPU split")
    args = parser.parse_args()
    if args.checkout is not None:
        global ROOT, ENVIRONMENT
        ROOT = args.checkout.resolve()
        # that checkout's tasks.py gives its children its own .venv's variables
        ENVIRONMENT = {key: value for key, value in os.environ.items() if key != "TORCH_EXTENSIONS_DIR"}
    print(f"{os.cpu_count()} CPUs; {load()}")
    if args.only in (None, "startup"):
        startup()
    if args.only in (None, "changed"):
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout
        if dirty:
            print(f"--changed needs a clean working tree (it would select these too):\n{dirty}")
            return 1
        changed_loop(ROOT / args.page, "\n", 20.0, own_runs=False)
        changed_loop(ROOT / args.snippet, "# an edit, as an author makes one (benchmarks/suite_floor.py)\n", 25.0,
                     own_runs=True)
    if args.only in (None, "suite"):
        whole_suite([sys.executable, "tasks.py", "test"], "whole suite, tasks.py test", 360.0)
    if args.only in (None, "second-pass"):
        whole_suite([sys.executable, "tasks.py", "test", "-m", "not slow and not kernel_independent",
                     "--smallest-rank-count", "tests/zero3", "tests/pipeline", "tests/transformers"],
                    ".ci/run's second pass, ATEN_CPU_CAPABILITY=default", 12 * 60 - 160 - 360,
                    {"ATEN_CPU_CAPABILITY": "default"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
