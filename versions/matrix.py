"""The DeepSpeed version matrix: one environment per release, the version-sensitive examples
run in each with real `torchrun`, the outcomes kept in versions/matrix.json.

    python3 tasks.py matrix                 build what is missing, run everything, write the data
    python3 tasks.py matrix --check         run everything, fail if any release differs from the data
    python3 tasks.py matrix --render        only regenerate snippets/versions/*.md from the data
    python3 tasks.py matrix --release 0.16.4 --release 0.19.8   only these releases
    python3 tasks.py matrix --repeat 5      run every documented command 5 times

This module is the command line: its options and the flow (build and run each release, then
write or compare the data, then render the notes). The package's other modules do the work
(versions/README.md lists them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from versions.data import compare_rows, load_data, save_data
from versions.environments import locked, log
from versions.notes import write_generated
from versions.plan import load_releases, pinned_in_constraints, release_key, releases, torch_pin
from versions.runs import run_release


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tasks.py matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with versions/matrix.json instead of writing it; exit 1 on a difference")
    parser.add_argument("--render", action="store_true", help="only regenerate snippets/versions/*.md")
    parser.add_argument("--release", action="append", help="only this release (repeatable)")
    parser.add_argument("--example", action="append", help="only commands containing this text (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of every documented command (default 1)")
    parser.add_argument("--timings", type=Path, help="write build and run times (JSON) here")
    args = parser.parse_args(argv)
    config = load_releases()
    if config["pinned"] != pinned_in_constraints():
        raise SystemExit(f"versions/releases.toml pins {config['pinned']}, constraints.txt {pinned_in_constraints()}")
    if args.render:
        write_generated()
        return 0
    chosen = args.release or releases(config)
    unknown = [v for v in chosen if v not in config["releases"]]
    if unknown:
        raise SystemExit(f"not in versions/releases.toml: {', '.join(unknown)}")
    data = load_data()
    data["torch"] = torch_pin()
    data["python"] = sys.version.split()[0]
    data["pinned"] = config["pinned"]
    started = time.monotonic()
    timings = {}
    failures = []
    for version in chosen:
        log(f"--- deepspeed {version}")
        result = run_release(version, config, args.repeat, args.example)
        timings[version] = result["timings"]
        new = result["row"]
        old = data["releases"].get(version)
        if args.check:
            problems = compare_rows(old, new, partial=bool(args.example))
            failures += [f"{version}: {problem}" for problem in problems]
        else:
            # After every release (an interrupted run keeps what it measured), re-reading the
            # file: another matrix process may have written other releases meanwhile.
            with locked(".data.lock"):
                data = {**load_data(), "torch": data["torch"], "python": data["python"], "pinned": data["pinned"]}
                old = data["releases"].get(version)
                if args.example and old and "examples" in old and "examples" in new:
                    new["examples"] = {**old["examples"], **new["examples"]}
                if args.example and old and (old.get("with_packages") or new.get("with_packages")):
                    new["with_packages"] = {**old.get("with_packages", {}), **new.get("with_packages", {})}
                data["releases"][version] = new
                data["releases"] = dict(sorted(data["releases"].items(), key=lambda item: release_key(item[0])))
                save_data(data)
        log(f"{version}: {round(time.monotonic() - started)} s so far")
    timings["total_seconds"] = round(time.monotonic() - started, 1)
    log(f"matrix: {timings['total_seconds']} s for {len(chosen)} releases")
    if args.timings:
        args.timings.write_text(json.dumps(timings, indent=1) + "\n")
    if args.check:
        for failure in failures:
            print(f"matrix: DIFFERS {failure}", file=sys.stderr)
        return 1 if failures else 0
    with locked(".data.lock"):
        write_generated(load_data())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
