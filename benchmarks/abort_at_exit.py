"""Benchmark: how often a documented torchrun command aborts at exit, beside CPU burners.

    .venv/bin/python benchmarks/abort_at_exit.py [--runs 40] [--max-minutes 60]
        [--burners N] [--stacks DIR] [SNIPPET ...]

Runs each documented command (default: the README's,
`DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/language_model.py`; N is the
one in the snippet's docstring) RUNS times, the commands in turn, beside one
`python3 -c 'while True: pass'` per core (--burners changes the count), and counts the runs that ended in `terminate called without an active exception` (SIGABRT on a
rank). The ranks run with core dumps on (`ulimit -c unlimited`) in a directory of the run's
own, so when one aborts, its core is there: the script keeps `gdb -batch -ex "thread apply all bt"` of
it under --stacks, prints the aborting thread's frames, and deletes the core (a rank's core is
~1 GB). Other failures are counted apart. Prints every run with the load average, then per
command: runs, aborts, other failures, and the load average's range.

A snippet given as python:PATH runs as `python PATH` (a command documented that way, the
checker's). Core files need the system's `/proc/sys/kernel/core_pattern` to be a plain file
name (`core`, as here); the script says so when it is not, and counts aborts from the message
all the same.
Bounded: at most --runs runs per command and --max-minutes in all; Ctrl-C or SIGTERM stops the
burners and the running command. Not part of the test suite: rates belong here, not in asserts.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rankrun.project import free_port

ROOT = Path(__file__).resolve().parent.parent

README_COMMAND = "snippets/zero3/language_model.py"
PLAIN = "python:"  # python:SNIPPET runs `python SNIPPET` instead of torchrun
ABORT_AT_EXIT = "terminate called without an active exception"
CORE_PATTERN = Path("/proc/sys/kernel/core_pattern")


def documented_ranks(snippet: str) -> int:
    """N of the `torchrun --nproc_per_node N` command in the snippet's docstring (2 if none)."""
    found = re.search(r"--nproc_per_node (\d+)", (ROOT / snippet.removeprefix(PLAIN)).read_text())
    return int(found.group(1)) if found else 2


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def start_burners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    """End each process, everything below it (torchrun starts its ranks in sessions of their
    own) and its session, then reap it."""
    import psutil

    for process in processes:
        if process.poll() is None:
            try:
                below = psutil.Process(process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                below = []
            for child in below:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def allow_core_dumps() -> None:
    """In the child before exec: no limit on core size, for torchrun and the ranks it starts."""
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def aborting_thread(backtrace: str) -> str:
    """The frames of the thread that called std::terminate (gdb's text of that thread), or ''."""
    threads = re.split(r"\n(?=Thread \d+ )", backtrace)[1:]  # [0]: gdb's header
    for thread in threads:
        if "std::terminate" in thread:
            return thread.strip()
    return ""


def keep_stacks(run_dir: Path, stacks: Path, label: str) -> list[Path]:
    """gdb's backtrace of every core the ranks left in run_dir, written under stacks; cores removed."""
    kept = []
    for core in sorted(run_dir.rglob("core*")):
        if not core.is_file():
            continue
        out = stacks / f"{label}-{core.name}.txt"
        done = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt", str(Path(sys.executable).resolve()),
                               str(core)], capture_output=True, text=True, timeout=600)
        out.write_text(done.stdout + done.stderr)
        core.unlink()
        kept.append(out)
    return kept


class Budget:
    def __init__(self, minutes: float):
        self.ends = time.monotonic() + minutes * 60

    def left(self) -> float:
        return self.ends - time.monotonic()


def run_once(snippet: str, nproc: int, timeout: float, run_dir: Path, children: list) -> tuple[int, str, float]:
    """One `DS_ACCELERATOR=cpu torchrun --nproc_per_node N SNIPPET` as the README runs it (the
    environment's torchrun, its own TORCH_EXTENSIONS_DIR), with the snippet named by its absolute
    path and run_dir as the working directory: the kernel writes an aborted rank's core there."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.update(DS_ACCELERATOR="cpu", PET_MASTER_PORT=str(free_port()),
               TORCH_EXTENSIONS_DIR=env.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions")),
               # as in the README's activated environment: its ninja builds DeepSpeed's op, so the
               # op the commands built is reused (another ninja rebuilds it: docs/testing.md)
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    if snippet.startswith(PLAIN):  # a command documented as `python SNIPPET`
        command = [sys.executable, str(ROOT / snippet[len(PLAIN):])]
    else:
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(nproc), str(ROOT / snippet)]
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, preexec_fn=allow_core_dumps)
    children.append(process)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop([process])
        output = (process.stdout.read() if process.stdout else "") + f"\n[benchmark] timed out after {timeout:.0f} s"
    children.remove(process)
    return process.returncode, output, time.monotonic() - started


def report(totals: list, burners: int) -> None:
    print("\n[benchmark] summary (load average: the 1-minute figure, highest of before and after each run)")
    for snippet, counts in totals:
        loads = counts["loads"] or [0.0]
        seconds = sorted(counts["seconds"]) or [0.0]
        print(f"{snippet}: {counts['aborts']} aborts in {counts['runs']} runs, {counts['failed']} other failures; "
              f"load {min(loads):.1f}-{max(loads):.1f} (mean {sum(loads) / len(loads):.1f}); "
              f"median run {seconds[len(seconds) // 2]:.1f} s; {burners} burners")
        for path in counts["stacks"]:
            print(f"  stack: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snippets", nargs="*", default=[README_COMMAND],
                        help="snippet paths from the repository root (default: the README's command); "
                             f"{PLAIN}PATH runs `python PATH` instead of torchrun")
    parser.add_argument("--runs", type=int, default=40, help="runs per command (at most 1000)")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="stop starting runs after this (all commands)")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1, help="CPU burners (default: one per core)")
    parser.add_argument("--nproc", type=int, default=0,
                        help="--nproc_per_node (default: the rank count of the snippet's documented command)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--stacks", type=Path, default=Path(tempfile.gettempdir()) / "abort_at_exit_stacks",
                        help="where gdb's stacks of aborted ranks are kept")
    args = parser.parse_args()
    args.runs = max(1, min(args.runs, 1000))
    args.stacks.mkdir(parents=True, exist_ok=True)
    if not shutil.which("gdb"):
        print("[benchmark] gdb is missing (apt-get install gdb): aborts are counted, no stacks kept")
    pattern = CORE_PATTERN.read_text().strip() if CORE_PATTERN.exists() else "?"
    if "/" in pattern or pattern.startswith("|"):
        print(f"[benchmark] core_pattern is {pattern!r}, not a plain name: the ranks' cores do not land in their "
              "directories (as root: echo core > /proc/sys/kernel/core_pattern); aborts are counted, no stacks kept")

    children: list[subprocess.Popen] = []
    burners = start_burners(args.burners)

    def interrupted(signum, _frame):
        stop(children + burners)
        print(f"\n[benchmark] stopped by signal {signum}; burners and the running command ended")
        sys.exit(130)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    budget = Budget(args.max_minutes)
    args.nproc_of = lambda snippet: args.nproc or documented_ranks(snippet)
    totals = [(snippet, {"runs": 0, "aborts": 0, "failed": 0, "loads": [], "seconds": [], "stacks": []})
              for snippet in args.snippets]
    try:
        print(f"[benchmark] {args.burners} burners, {args.runs} runs per command, at most {args.max_minutes:g} min; "
              f"python {sys.version.split()[0]}; stacks in {args.stacks}", flush=True)
        # Round robin over the commands: each sees the same load, whatever the others do meanwhile.
        for index in range(args.runs):
            for snippet, counts in totals:
                if budget.left() <= 0:
                    break
                with tempfile.TemporaryDirectory(prefix="abort_at_exit_") as tmp:
                    load_before = load_average()
                    code, output, seconds = run_once(snippet, args.nproc_of(snippet), min(args.timeout, budget.left() + 60),
                                                     Path(tmp), children)
                    load = max(load_before, load_average())
                    counts["runs"] += 1
                    counts["loads"].append(load)
                    counts["seconds"].append(seconds)
                    aborted = ABORT_AT_EXIT in output or "Signal 6 (SIGABRT)" in output
                    verdict = "ok" if code == 0 else ("ABORT" if aborted else "FAILED")
                    line = f"{snippet} run {index + 1}: {verdict} (exit {code}, {seconds:.1f} s, load {load:.1f})"
                    if aborted:
                        counts["aborts"] += 1
                        label = f"{Path(snippet).stem}-{time.strftime('%Y%m%d-%H%M%S')}-run{index + 1}"
                        (args.stacks / f"{label}-output.txt").write_text(output)
                        kept = keep_stacks(Path(tmp), args.stacks, label) if shutil.which("gdb") else []
                        counts["stacks"].extend(kept)
                        line += f"; stacks: {', '.join(str(p) for p in kept) or 'no core found'}"
                        for path in kept:
                            frames = aborting_thread(path.read_text())
                            if frames:
                                print(frames[:6000], flush=True)
                    elif code != 0:
                        counts["failed"] += 1
                        line += "\n" + output[-3000:]
                    print(line, flush=True)
            if budget.left() <= 0:
                print("[benchmark] time budget spent", flush=True)
                break
    finally:
        stop(children + burners)
        report(totals, args.burners)
    return 0


if __name__ == "__main__":
    sys.exit(main())
