"""Benchmark: check_shared_reads.py against real ZeRO-3 runs on generated models.

    .venv/bin/python benchmarks/check_shared_reads_generated.py [--count 300] [--chunk 50]
        [--four-ranks 40] [--family reads|copies]

Two families of generated models: "reads" (snippets/zero3/generated_models.py, a weight read
in every way a forward can read it) and "copies" (snippets/zero3/generated_copies.py, a
constructor that copies a partitioned module or weight, a forward or loop that writes into
a gathered weight). For "copies" the checker agrees when it names exactly the parameters
the model's spec leaves wrong (its `affected`), and nothing for a model that works.

For each model of snippets/zero3/generated_models.py (seeded), the checker's verdict (one
rank: no findings, or which parameters) is compared with a real 2-rank ZeRO-3 run compared
with plain PyTorch (works = every step's loss and every full gradient within the project's
tolerance on every rank; otherwise it fails or is silently wrong). The first --four-ranks
models also run on 4 ranks. Many models train one after another in one launch (--chunk per
launch). Prints agree/disagree per value of every dimension, every disagreement, the errors
the runs raised, the wall time and the load average. Not part of the suite: the suite runs
a sample (tests/zero3/test_generated_models.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import time
from pathlib import Path

from rankrun.runner import close_pools, run_snippet
from rankrun.tolerance import matches

SNIPPETS = {"reads": "snippets/zero3/generated_models.py",
            "copies": "snippets/zero3/generated_copies.py"}
SNIPPET = SNIPPETS["reads"]
SHARED = "block.owner.weight"


def real_outcome(per_rank):
    """'works', 'silently wrong', or 'fails <where>: <error>' from every rank's result."""
    outcomes = set()
    for got in per_rank:
        zero3, plain = got["zero3"], got["plain"]
        if "error" in zero3:
            outcomes.add(f"fails {zero3['where']}: {zero3['error']}")
        elif matches(zero3["losses"], plain["losses"]) and matches(zero3["grads"], plain["grads"]):
            outcomes.add("works")
        else:
            outcomes.add("silently wrong")
    return " | ".join(sorted(outcomes))


def checker_verdict(findings):
    """'no findings', or the sorted parameters found (an error the checker hit: '(unknown)')."""
    names = sorted({f["parameter"] for f in findings})
    return "no findings" if not names else "finds " + ", ".join(names)


def agrees(outcome, verdict, affected=None):
    """No findings for a model that works; else exactly the parameters it leaves wrong
    (`affected`, for the copies; the shared weight, for the reads)."""
    if outcome == "works":
        return verdict == "no findings"
    expected = [SHARED] if affected is None else affected
    return verdict == "finds " + ", ".join(sorted(expected))


def run(first, count, world_size, call, timeout, snippet=SNIPPET):
    env = {"GENERATED_MODELS": f"{first}:{count}"}
    result = run_snippet(snippet, world_size, call=call, env=env, timeout=timeout).check()
    return [result.returned(rank) for rank in range(world_size)]


def compare(first, count, chunk, world_size, timeout, snippet=SNIPPET):
    rows = {}
    for start in range(first, first + count, chunk):
        n = min(chunk, first + count - start)
        real = run(start, n, world_size, "main", timeout, snippet)
        checked = (run(start, n, 1, "checker_verdicts", timeout, snippet)[0]
                   if world_size == 2 else None)
        for index in real[0]:
            rows[index] = {"spec": real[0][index]["spec"],
                           "affected": real[0][index].get("affected"),
                           "outcome": real_outcome([r[index] for r in real]),
                           "verdict": checker_verdict(checked[index][1]) if checked else None,
                           "findings": checked[index][1] if checked else None}
        print(f"  models {start}..{start + n - 1} on {world_size} ranks done", flush=True)
        if os.environ.get("GENERATED_ROWS"):  # every row, as JSON lines, for later counts
            with open(os.environ["GENERATED_ROWS"], "a") as out:
                for index in range(start, start + n):
                    out.write(json.dumps({"index": index, "ranks": world_size, **rows[index]}) + "\n")
    return rows


def fix_parts(flagged, chunk, limit=100_000):
    """The flagged models' findings in parts of at most `chunk` models and `limit` characters
    of JSON: Linux refuses to start a program (here `ninja --version`, which DeepSpeed runs)
    with an environment string over 128 KiB, and the findings travel in one."""
    part = {}
    for index in sorted(flagged):
        if part and (len(part) == chunk or
                     len(json.dumps({**part, str(index): flagged[index]})) > limit):
            yield part
            part = {}
        part[str(index)] = flagged[index]
    if part:
        yield part


def mend(rows, world_size, chunk, timeout, snippet=SNIPPET):
    """Every model the checker flagged, trained again on `world_size` ranks with the fixes
    it proposed applied as it states them: {index: real outcome}."""
    flagged = {i: r["findings"] for i, r in rows.items() if r["findings"]}
    outcomes, indices = {}, sorted(flagged)
    for part in fix_parts(flagged, chunk):
        env = {"GENERATED_FIXES": json.dumps(part)}
        result = run_snippet(snippet, world_size, call="main", env=env, timeout=timeout).check()
        runs = [result.returned(rank) for rank in range(world_size)]
        for index in runs[0]:
            outcomes[index] = real_outcome([r[index] for r in runs])
        print(f"  {len(outcomes)} of {len(indices)} fixed models on {world_size} ranks done",
              flush=True)
    return outcomes


def report_mend(outcomes, label):
    mended = sum(o == "works" for o in outcomes.values())
    print(f"\nfixes that mend, {label}: {mended} of {len(outcomes)} flagged models")
    for index, outcome in sorted(outcomes.items()):
        if outcome != "works":
            print(f"  NOT MENDED model {index}: {outcome}")


def same_message(outcome):
    """ZeRO-3's AssertionError names the parameter's ds_id and its modules' ids, which
    differ from model to model: one message, with those left out."""
    outcome = re.sub(r"'id': \d+", "'id': …", outcome)
    return re.sub(r"'active_sub_modules': \{[\d, ]*\}", "'active_sub_modules': {…}", outcome)


def agrees_row(r):
    return agrees(r["outcome"], r["verdict"], r.get("affected"))


def report(rows, label):
    agree = sum(agrees_row(r) for r in rows.values())
    print(f"\n{label}: {len(rows)} models, checker agrees on {agree}, disagrees on {len(rows) - agree}")
    works = sum((r["outcome"] == "works") == (r["verdict"] == "no findings") for r in rows.values())
    print(f"  works or not (no findings or some): agrees on {works} of {len(rows)}")
    spec_keys = list(next(iter(rows.values()))["spec"])
    for key in spec_keys:
        counts = collections.defaultdict(lambda: [0, 0])
        for r in rows.values():
            counts[str(r["spec"][key])][0 if agrees_row(r) else 1] += 1
        cells = ", ".join(f"{value}: {a}/{d}" for value, (a, d) in sorted(counts.items()))
        print(f"  {key} (agree/disagree): {cells}")
    for key in [k for k in ("register", "entry", "compute", "construct", "write", "writer")
                if k in spec_keys]:
        counts = collections.defaultdict(collections.Counter)
        for r in rows.values():
            counts[r["spec"][key]]["works" if r["outcome"] == "works" else "fails"] += 1
        cells = ", ".join(f"{v}: {c['works']}/{c['fails']}" for v, c in sorted(counts.items()))
        print(f"  real runs by {key} (works/fails or silently wrong): {cells}")
    outcomes = collections.Counter(same_message(r["outcome"]) for r in rows.values())
    print("  outcomes of the real runs:")
    for outcome, n in outcomes.most_common():
        print(f"    {n:4d}  {outcome}")
    for index, r in sorted(rows.items()):
        if not agrees_row(r):
            print(f"  DISAGREE model {index}: {r['spec']}\n    run: {r['outcome']}\n"
                  f"    checker: {r['verdict']} {r['findings']}")


# Access paths whose read the getter of ZeRO-3's module attribute does not see.
HIDDEN = {"named_parameters", "parameters", "state_dict", "list of Parameter",
          "dict of Parameter", "object with Parameter"}


def works(r):
    return "works" if r["outcome"] == "works" else "fails"


SOUND = ("constructors", "copy.deepcopy inside GatheredParameters")


def breakdown_copies(rows):
    """The copies: the real 2-rank runs, works/fails, by construct (of the models whose
    writes, if any, are kept) and by write (of the models with a sound construct)."""
    parts = ((("construct",), "models without a lost write",
              lambda s: s["write"] == "none" or s["writer"] == "loop, both copies"),
             (("write", "writer"), "models with a sound construct",
              lambda s: s["construct"] in SOUND))
    for keys, which, chosen in parts:
        table = collections.defaultdict(collections.Counter)
        for r in rows.values():
            if chosen(r["spec"]):
                table[tuple(str(r["spec"][k]) for k in keys)][works(r)] += 1
        print(f"\nreal 2-rank runs, {which}: works/fails by {', '.join(keys)}")
        for key in sorted(table):
            print(" ", " | ".join(key), f"{table[key]['works']}/{table[key]['fails']}")
    print("\nreal 2-rank runs without a lost write, by construct: what they did")
    seen = collections.defaultdict(collections.Counter)
    for r in rows.values():
        if parts[0][2](r["spec"]):
            outcome = " ".join(same_message(r["outcome"]).split())
            seen[r["spec"]["construct"]][outcome] += 1
    for construct in sorted(seen):
        for outcome, n in seen[construct].most_common():
            print(f"  {construct}: {n} x {outcome}")


def breakdown(rows):
    """The real 2-rank runs, works/fails, by what decides them."""
    if "construct" in next(iter(rows.values()))["spec"]:
        return breakdown_copies(rows)
    table = collections.defaultdict(collections.Counter)
    for r in rows.values():
        s = r["spec"]
        path = "not seen by the getter" if s["access"] in HIDDEN else "through the owner's attribute"
        table[(path, s["compute"], s["register"])][works(r)] += 1
    print("\nreal 2-rank runs: works/fails by access path, compute, registration")
    for key in sorted(table):
        print(" ", " | ".join(key), f"{table[key]['works']}/{table[key]['fails']}")
    table = collections.defaultdict(collections.Counter)
    for r in rows.values():
        s = r["spec"]
        if s["access"] in HIDDEN or s["register"] != "nowhere":
            continue
        gap = any(s["read slot"] <= c < s["use slot"] for c in range(s["owner calls"]))
        timing = "owner call between read and use" if gap else "no owner call between"
        table[(s["entry"], timing)][works(r)] += 1
    print("attribute paths, registered nowhere: works/fails by entry and timing")
    for key in sorted(table):
        print(" ", " | ".join(key), f"{table[key]['works']}/{table[key]['fails']}")


def report_rows(path):
    """The report of the rows a run wrote, also of a run that stopped before the end."""
    rows, four = {}, {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        (rows if row["ranks"] == 2 else four)[row["index"]] = row
    report(rows, "2 ranks")
    four = {i: {**r, "verdict": rows[i]["verdict"], "findings": rows[i]["findings"],
                "affected": rows[i].get("affected")} for i, r in four.items() if i in rows}
    if four:
        report(four, "4 ranks")
        same = sum(four[i]["outcome"] == rows[i]["outcome"] for i in four)
        print(f"  4-rank outcome equals the 2-rank outcome for {same} of {len(four)} models")
    breakdown(rows)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--four-ranks", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--from-rows", help="report the rows a run wrote (GENERATED_ROWS)")
    parser.add_argument("--mend-only", action="store_true",
                        help="with --from-rows: train the flagged models with their fixes")
    parser.add_argument("--family", choices=sorted(SNIPPETS), default="reads")
    args = parser.parse_args()
    snippet = SNIPPETS[args.family]
    started = time.perf_counter()
    if args.from_rows and args.mend_only:
        rows = {}
        for line in Path(args.from_rows).read_text().splitlines():
            row = json.loads(line)
            if row["ranks"] == 2:
                rows[row["index"]] = row
        try:
            report_mend(mend(rows, 2, args.chunk, args.timeout, snippet), "2 ranks")
        finally:
            close_pools()
        print(f"\nwall {time.perf_counter() - started:.0f} s; load average {os.getloadavg()}")
        return None
    if args.from_rows:
        return report_rows(args.from_rows)
    try:
        rows = compare(args.first, args.count, args.chunk, 2, args.timeout, snippet)
        report(rows, "2 ranks")
        report_mend(mend(rows, 2, args.chunk, args.timeout, snippet), "2 ranks")
        if args.four_ranks:
            four = compare(args.first, args.four_ranks, args.chunk, 4, args.timeout, snippet)
            same = sum(four[i]["outcome"] == rows[i]["outcome"] for i in four)
            for i in four:
                four[i]["verdict"], four[i]["findings"] = rows[i]["verdict"], rows[i]["findings"]
                four[i]["affected"] = rows[i]["affected"]
            report(four, "4 ranks")
            print(f"  4-rank outcome equals the 2-rank outcome for {same} of {len(four)} models")
        breakdown(rows)
    finally:
        close_pools()
    print(f"\nwall {time.perf_counter() - started:.0f} s; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
