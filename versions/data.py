"""The version matrix's data, versions/matrix.json: reading and writing it, what a reader sees
of a run (its transcript), how a release's runs differ from the pinned release's, and what
`--check` reports when a fresh row differs from the committed one."""

from __future__ import annotations

import difflib
import json
import sys

from versions.outputs import printed
from versions.plan import ROOT, commands, load_releases, release_key, releases

DATA_FILE = ROOT / "versions" / "matrix.json"


def load_data() -> dict:
    if not DATA_FILE.is_file():
        return {"releases": {}}
    return json.loads(DATA_FILE.read_text())


def save_data(data: dict) -> None:
    DATA_FILE.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")


def ran_releases(data: dict, command: str) -> list[str]:
    return sorted((version for version, row in data["releases"].items()
                   if command in row.get("examples", {})), key=release_key)


def transcript(entry: dict) -> list[str]:
    """What a reader sees from a run, rank 0 first: printed lines, then the exception of any rank."""
    lines = []
    for text in entry["printed"]:
        lines += printed(text).splitlines()
    return lines + entry["raised"]


def differences(entry: dict, pinned: dict) -> list[tuple[str, str, str]]:
    """(context, line on this release, line on the pinned release) for every changed line.

    The context is the nearest unindented line above the change (a pattern's name in the
    automatic-detection table, `step 0: loss ...` in ModuleZ3)."""
    mine, theirs = transcript(entry), transcript(pinned)
    found = []
    matcher = difflib.SequenceMatcher(a=mine, b=theirs, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        context = ""
        for line in reversed(theirs[:b0]):
            if line and not line[0].isspace():
                context = line
                break
        here, there = mine[a0:a1], theirs[b0:b1]
        for i in range(max(len(here), len(there))):
            found.append((context, here[i].strip() if i < len(here) else "(no line)",
                          there[i].strip() if i < len(there) else "(no line)"))
    return found


def summary(data: dict | None = None, config: dict | None = None) -> dict:
    """Per example and changed line: the releases that differ from the pinned one."""
    data = data or load_data()
    config = config or load_releases()
    pinned = config["pinned"]
    pinned_row = data["releases"].get(pinned, {}).get("examples", {})
    changes = {}  # (command, context, pinned line) -> {release: line there}
    for version in releases(config):
        row = data["releases"].get(version)
        if not row or not row.get("probe", {}).get("ok"):
            continue
        for key, entry in row.get("examples", {}).items():
            if key not in pinned_row:
                continue
            for context, here, there in differences(entry, pinned_row[key]):
                changes.setdefault((key, context, there), {})[version] = here
    return changes


def grouped(data: dict, config: dict) -> dict[str, list[tuple[list[str], dict]]]:
    """Per command: the releases whose transcript differs from the pinned one, grouped by transcript."""
    pinned = config["pinned"]
    result = {}
    for command in commands(config):
        pinned_entry = data["releases"].get(pinned, {}).get("examples", {}).get(command)
        groups: dict[tuple, tuple[list[str], dict]] = {}
        for version in ran_releases(data, command):
            entry = data["releases"][version]["examples"][command]
            key = tuple(transcript(entry))
            if pinned_entry is None or key == tuple(transcript(pinned_entry)):
                continue
            groups.setdefault(key, ([], entry))[0].append(version)
        result[command] = list(groups.values())
    return result


def comparable(entry: dict) -> dict:
    return {"printed": [printed(text) for text in entry["printed"]], "raised": entry["raised"],
            "ok": entry["ok"], "timed_out": entry["timed_out"]}


def compare_rows(old: dict | None, new: dict, partial: bool = False) -> list[str]:
    """What differs between the committed row of a release and a fresh one (timings are not
    compared; a run that aborted at exit failed, so it differs in `ok`)."""
    if old is None:
        return ["not in versions/matrix.json"]
    problems = []
    if old["probe"] != new["probe"]:
        problems.append(f"import: committed {old['probe']}, now {new['probe']}")
    for key, entry in new.get("examples", {}).items():
        committed = old.get("examples", {}).get(key)
        if committed is None:
            problems.append(f"{key}: not in versions/matrix.json")
            continue
        if comparable(committed) != comparable(entry):
            diff = "\n".join(difflib.unified_diff(transcript(committed), transcript(entry), "committed", "now",
                                                  lineterm=""))
            problems.append(f"{key}: differs\n{diff}")
        if entry["aborted_at_exit"]:
            print(f"matrix: note: {key} aborted at exit in {entry['aborted_at_exit']} of {entry['runs']} runs",
                  file=sys.stderr)
    for key, entry in new.get("with_packages", {}).items():
        committed = old.get("with_packages", {}).get(key)
        if committed is None:
            problems.append(f"{key}: not in versions/matrix.json")
        elif comparable(committed) != comparable(entry):
            diff = "\n".join(difflib.unified_diff(transcript(committed), transcript(entry), "committed", "now",
                                                  lineterm=""))
            problems.append(f"{key}: differs\n{diff}")
    for key in old.get("examples", {}):
        if key not in new.get("examples", {}) and not partial:
            problems.append(f"{key}: in versions/matrix.json but not run")
    return problems
