"""Benchmark: check_shared_reads.py on real Transformers architectures, against real runs.

    .venv/bin/python benchmarks/check_shared_reads_architectures.py \
        > snippets/zero3/check_shared_reads_architectures.txt

For every architecture of snippets/zero3/check_architectures.py and each of its cases (the
model alone; a chunked loss that reads the output head in the loop; from_config under
HfDeepSpeedConfig, for the Transformers ones), in a fresh process per architecture: the checker's findings (one CPU
process: its seconds and the process's peak memory). Then, per architecture, one 2-rank
ZeRO-3 launch trains every case 3 steps and each case the checker flagged again with every
proposed fix applied as the checker states it; rank 0 trains the one-process references.
Prints a Markdown table (architecture, case, checker verdict, run verdict, agreement, the
run with the fixes), the count of fixes that mend, the cost table, and the load average.
The suite runs a sample (tests/zero3/test_check_architectures.py), which imports the
verdicts below and checks the sample's rows against the table this prints.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rankrun.reference import example_namespace
from rankrun.runner import close_pools, run_snippet
from rankrun.tolerance import matches

ROOT = Path(__file__).resolve().parent.parent

SNIPPET = "snippets/zero3/check_architectures.py"
CASES = ("model alone", "loss reads the head", "from_config")


def assert_user_can_write(findings, label=""):
    """Every finding names its parameter by a path from the model (or where it is held),
    never by a DeepSpeed id, and its fix is Python that compiles (a `with` line with a
    body under it)."""
    for f in findings:
        assert "ds_id" not in f["parameter"], (label, f)
        line = f["fix"] + ("\n    pass" if f["fix"].endswith(":") else "")
        try:
            compile(line, "<fix>", "exec")
        except SyntaxError as error:
            raise AssertionError(f"{label}: the fix line does not compile: {f}") from error


def checker_verdict(findings):
    """(parameters the checker found in the constructor, those found while training)."""
    constructor = sorted({f["parameter"] for f in findings if f["phase"] == "constructor"})
    training = sorted({f["parameter"] for f in findings if f["phase"] != "constructor"})
    return constructor, training


def run_verdict(row):
    """From one row of check_architectures.main() on rank 0: (the parameters whose initial
    weights differ from the one-process build's, those Transformers' init never writes,
    'works', 'silently wrong' or 'fails <where>: <error>' for the training, and the
    parameters that start empty: copies of a partitioned module, say)."""
    zero3, init = row["zero3"], row["plain init"]
    if "initial" not in zero3:  # it raised while building
        return None, [], f"fails {zero3['where']}: {zero3['error']}", []
    differ = sorted(n for n, t in zero3["initial"].items() if not matches(t, init[n]))
    never = sorted(n for n, t in init.items() if t.isnan().any())
    empty = sorted(n for n, t in zero3["initial"].items() if t.numel() == 0 < init[n].numel())
    if "error" in zero3:
        outcome = f"fails {zero3['where']}: {zero3['error']}"
    elif same_steps(zero3, row["plain"]):
        outcome = "works"
    else:
        outcome = "silently wrong"
    return differ, never, outcome, empty


def module_scale(want, name):
    """The magnitude a gradient's rounding is relative to: the largest entry of the
    gradients of its module (a bias's gradient can be a sum that cancels, even to zero: an
    attention key's bias shifts every score of a query equally)."""
    module = name.rpartition(".")[0]
    return max(t.abs().max().item() for n, t in want.items()
               if n.rpartition(".")[0] == module and t.numel())


def same_steps(zero3, plain):
    """Every step's loss and full gradients equal those of one process from the same
    weights, and every update is SGD's: the next weights are these minus lr x gradient."""
    if not matches(zero3["losses"], plain["losses"]):
        return False
    for step, (got, want) in enumerate(zip(zero3["grads"], plain["grads"])):
        if got.keys() != want.keys() or not all(
                matches(got[n], want[n], scale=module_scale(want, n) or None) for n in want):
            return False
        before, after = zero3["weights"][step], zero3["weights"][step + 1]
        stepped = {n: before[n] - zero3["lr"] * got[n] for n in before}
        if not matches(after, stepped):
            return False
    return len(zero3["grads"]) == len(plain["grads"]) == len(zero3["weights"]) - 1


def agrees(checker, run, head):
    """The checker names exactly the weights whose initial values differ, and, in training,
    nothing when the run works and the head's weight when it does not (or nothing, when
    weights the checker names start empty: the run cannot train them)."""
    constructor, training = checker
    differ, never, outcome, empty = (*run, [])[:4]
    if differ is None:  # the build raised: the checker must have found the constructor's use
        return bool(constructor)
    if constructor != differ or never:
        return False
    if outcome == "works":
        return not training
    return training == [head] or (not training and bool(empty))


def mends(run):
    differ, never, outcome, *_ = run
    return not differ and not never and outcome == "works"


def describe_checker(checker):
    constructor, training = checker
    parts = [f"constructor: {len(constructor)} weights"] if constructor else []
    parts.append(f"training: {', '.join(f'`{t}`' for t in training)}" if training
                 else "training: nothing")
    return "; ".join(parts)


def describe_run(run):
    differ, never, outcome, empty = (*run, [])[:4]
    if differ is None:
        parts = []
    else:
        parts = [f"initial weights: {len(differ)} differ" if differ else "initial weights: equal"]
        if empty:
            parts[0] += f" ({len(empty)} empty)"
    if never:
        parts.append(f"{len(never)} never initialized")
    if outcome == "works":
        parts.append("training equals one process")
    elif outcome == "silently wrong":
        parts.append("training silently wrong")
    else:
        where, _, error = outcome.removeprefix("fails ").partition(": ")
        parts.append(f"fails {where}: `{error.split(':')[0]}`")
    return "; ".join(parts)


ONE = r"""
import json, resource
from rankrun.reference import example_namespace
example = example_namespace("snippets/zero3/check_architectures.py")
verdicts = example["checker_verdicts"]()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("VERDICTS " + json.dumps({"verdicts": verdicts, "peak_mib": peak}))
"""


def same_message(outcome):
    """ZeRO-3's AssertionError names a parameter's ds_id and its modules' ids, which differ
    from model to model: one message, with those left out."""
    outcome = re.sub(r"'id': \d+", "'id': …", outcome)
    return re.sub(r"'active_sub_modules': \{[\d, ]*\}", "'active_sub_modules': {…}", outcome)


def cases_of(name):
    return example_namespace(SNIPPET)["cases_of"](name)


def check_in_a_fresh_process(name):
    """The checker on the cases of one architecture, in a new process: its verdicts,
    seconds per case, the process's peak memory and the load average after it."""
    rows = [[name, case, None] for case in cases_of(name)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CHECK_ROWS": json.dumps(rows)}
    done = subprocess.run([sys.executable, "-c", ONE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3600)
    line = [x for x in done.stdout.splitlines() if x.startswith("VERDICTS ")]
    if done.returncode or not line:
        raise RuntimeError(f"checking {name} failed:\n{done.stderr[-3000:]}")
    got = json.loads(line[-1].removeprefix("VERDICTS "))
    got["load"] = os.getloadavg()
    return got


def train(rows, world_size, timeout):
    env = {"CHECK_ROWS": json.dumps(rows)}
    result = run_snippet(SNIPPET, world_size, call="main", env=env, timeout=timeout).check()
    return result.returned(0)


def parameters(name):
    example = example_namespace(SNIPPET)
    model = example["model_class"](name)(example["config_of"](name))
    return sum(p.numel() for p in model.parameters())


def measure(name, timeout):
    """One architecture: the checker's verdicts (a fresh process) and the 2-rank runs of
    every case, and of every flagged case again with its fixes. A JSON-ready record."""
    started = time.perf_counter()
    checked = check_in_a_fresh_process(name)
    findings = {case: f for _, case, f, _ in checked["verdicts"]}
    rows = [[name, case, None] for case in cases_of(name)] + [
        [name, case, findings[case]] for case in cases_of(name) if findings[case]]
    trained = train(rows, 2, timeout)
    plain = {r["case"]: r for r in trained if not r["fixed"]}
    fixed = {r["case"]: r for r in trained if r["fixed"]}
    return {
        "architecture": name, "parameters": parameters(name),
        "seconds": {case: s for _, case, _, s in checked["verdicts"]},
        "peak_mib": checked["peak_mib"], "load": checked["load"],
        "cases": {case: {"findings": findings[case], "head": plain[case]["head"],
                         "run": run_verdict(plain[case]),
                         "fixed": run_verdict(fixed[case]) if case in fixed else None}
                  for case in cases_of(name)},
        "wall_s": time.perf_counter() - started,
    }


def report(records):
    """The page's tables from the records, in the order of the architectures."""
    table, costs, mended, flagged, agreeing, total = [], [], 0, 0, 0, 0
    for record in records:
        for case, got in record["cases"].items():
            checker = checker_verdict(got["findings"])
            run = tuple(got["run"])
            agree = agrees(checker, run, got["head"])
            total += 1
            agreeing += agree
            fixed_text = "-"
            if got["fixed"] is not None:
                flagged += 1
                fixed_run = tuple(got["fixed"])
                mended += mends(fixed_run)
                fixed_text = ("mends: " if mends(fixed_run) else "does NOT mend: ") + (
                    describe_run(fixed_run))
            table.append((record["architecture"], case, describe_checker(checker),
                          describe_run(run), "yes" if agree else "**NO**", fixed_text))
    print("| architecture | case | checker (one process) | real run (2 ranks) | agree "
          "| with the checker's fixes (2 ranks) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in table:
        print("| " + " | ".join(row) + " |")
    print()
    print(f"Agreement: {agreeing} of {total} rows. Fixes that mend: {mended} of {flagged} "
          "flagged rows (every fix the checker proposed, applied as it states, trained "
          "again on 2 ranks).")
    print()
    raised = {}
    for record in records:
        for case, got in record["cases"].items():
            for run in (got["run"], got["fixed"]):
                if run is not None and run[2].startswith("fails"):
                    raised.setdefault(same_message(run[2]), []).append(
                        f"{record['architecture']} ({case})")
    print("What the real runs raised:")
    print()
    for outcome, where in raised.items():
        print(f"- {', '.join(where)}: {outcome.removeprefix('fails ')}")
    print()
    print("| architecture | parameters | checker seconds (alone, head loss, from_config) "
          "| peak memory | load average after |")
    print("| --- | --- | --- | --- | --- |")
    for record in records:
        cells = " / ".join(f"{record['seconds'][c]:.1f}" if c in record["seconds"] else "-"
                           for c in CASES)
        print(f"| {record['architecture']} | {record['parameters']:,} | {cells} "
              f"| {record['peak_mib']:.0f} MiB | {record['load'][0]:.1f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--architectures", help="comma-separated; default: all")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--records", default="/tmp/check_shared_reads_architectures.jsonl",
                        help="one JSON line per architecture; those already there are kept")
    args = parser.parse_args()
    example = example_namespace(SNIPPET)
    names = args.architectures.split(",") if args.architectures else list(example["ARCHITECTURES"])
    records = {}
    if Path(args.records).exists():
        for line in Path(args.records).read_text().splitlines():
            records[json.loads(line)["architecture"]] = json.loads(line)
    try:
        for name in names:
            if name in records:
                continue
            records[name] = measure(name, args.timeout)
            with open(args.records, "a") as out:
                out.write(json.dumps(records[name]) + "\n")
            print(f"  {name} done", file=sys.stderr, flush=True)
    finally:
        close_pools()
    report([records[name] for name in names])
    print()
    wall = sum(records[name]["wall_s"] for name in names)
    print(f"Wall time {wall:.0f} s (checker and runs, every architecture); load average at "
          f"the end {', '.join(f'{x:.1f}' for x in os.getloadavg())}; one CPU process per "
          "architecture for the checker, 2 gloo ranks for the runs.")


if __name__ == "__main__":
    main()
