"""What the pages show from the version matrix's data: the generated part of docs/versions.md
(a row per release, then every change from the pinned release with when it changed and the
upstream change behind it), and a note per example whose output differs on some release,
written to snippets/versions/*.md."""

from __future__ import annotations

import difflib
from pathlib import Path

from versions.data import grouped, load_data, ran_releases, transcript
from versions.environments import INSTALL_COMMAND
from versions.markup import code, footnotes_of, linked, row_change, shortened, table_header
from versions.outputs import printed
from versions.plan import (ROOT, commands, example_name, load_releases, parse_command, plain_command, release_key,
                           releases)

GENERATED = ROOT / "snippets" / "versions"


def span(versions: list[str], all_versions: list[str]) -> str:
    """`0.14.5 to 0.16.4` for a run of consecutive releases of the list, else a comma list."""
    if len(versions) == 1:
        return versions[0]
    indices = [all_versions.index(v) for v in versions]
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{versions[0]} to {versions[-1]}"
    return ", ".join(versions)


def release_after(versions: list[str], ran: list[str]) -> str | None:
    """The release (of those run) right after `versions`, if they are a consecutive run of them."""
    indices = [ran.index(v) for v in versions]
    if indices != list(range(indices[0], indices[-1] + 1)) or indices[-1] + 1 >= len(ran):
        return None
    return ran[indices[-1] + 1]


def when_changed(last_different: str, first_same: str) -> str:
    """`changed in 0.16.5` when the two releases are consecutive, else `changed between A and B`."""
    a, b = release_key(last_different), release_key(first_same)
    if a[:-1] == b[:-1] and b[-1] == a[-1] + 1:
        return f"changed in {first_same}"
    return f"changed between {last_different} and {first_same}"


def upstream_for(config: dict, command: str, release: str | None) -> dict | None:
    for item in config.get("upstream", []):
        if item["release"] == release and item["example"] == example_name(command):
            return item
    return None


def render_versions_page(data: dict, config: dict) -> str:
    """The generated part of docs/versions.md."""
    all_versions = releases(config)
    pinned = config["pinned"]
    out = []
    out.append(f"Every release was installed with `{INSTALL_COMMAND}` beside torch {data.get('torch')} "
               f"(Python {data.get('python')}).")
    out.append("")
    out.append("| Release | Runs the examples? | Needs | Exit abort seen |")
    out.append("|---|---|---|---|")
    for version in all_versions:
        row = data["releases"].get(version)
        if row is None:
            out.append(f"| {version} | not run yet | | |")
            continue
        if not row["probe"]["ok"]:
            out.append(f"| {version} | no: `{row['probe']['raised']}` at `import deepspeed` | | |")
            continue
        needs = ", ".join(f"`{k}={v}`" for k, v in row["env"].items())
        if row.get("without_env"):
            needs += " (without it: `" + "; ".join(row["without_env"]["raised"]) + "`)"
        aborts = [f"{entry['aborted_at_exit']} of {entry['runs']} runs of `{example_name(key)}`"
                  for key, entry in row["examples"].items() if entry["aborted_at_exit"]]
        runs = sum(entry["runs"] for entry in row["examples"].values())
        marker = " (pinned)" if version == pinned else ""
        out.append(f"| {version}{marker} | yes | {needs or 'nothing'} | "
                   f"{'; '.join(aborts) or f'no (in {runs} runs)'} |")
    out.append("")
    running = [v for v in all_versions if data["releases"].get(v, {}).get("probe", {}).get("ok")]
    partial: dict[tuple[str, ...], list[str]] = {}
    for command in commands(config):
        ran = ran_releases(data, command)
        if ran != running:
            names = partial.setdefault(tuple(ran), [])
            if example_name(command) not in names:
                names.append(example_name(command))
    for ran, names in partial.items():
        where = " and ".join(ran) if len(ran) <= 2 else ", ".join(ran)
        out.append(f"Run on {where} only (not run on the other releases): "
                   f"{', '.join(code(name.rsplit('/', 1)[1]) for name in names)}.")
        out.append("")
    with_packages: dict[str, list[str]] = {}
    for version in all_versions:
        for key in data["releases"].get(version, {}).get("with_packages", {}):
            packages = ", ".join(f"{name} {wanted}" for name, wanted in parse_command(key)[0].items())
            with_packages.setdefault(example_name(key), []).append(f"{version} with {packages}")
    for path, runs in with_packages.items():
        out.append(f"Run with other package versions, installed over the release's environment: "
                   f"{code(path.rsplit('/', 1)[1])} on {'; '.join(runs)} (what differs is in its note).")
        out.append("")
    by_command = grouped(data, config)
    if not any(groups for groups in by_command.values()):
        out.append(f"Every release that runs prints the same as {pinned} in every example of the matrix.")
        return "\n".join(out) + "\n"
    out.append(f"What differs from {pinned}: one line per change, with the releases it holds for "
               f"(and when it changed, where both sides ran), the example, and what its run printed "
               f"or raised there. An example not listed printed the same on every release it ran on; "
               f"so did every line not listed.")
    out.append("")
    for command, groups in by_command.items():
        if not groups:
            continue
        for change in changes_of(data, config, command):
            out.append(f"- {change_line(change, example_name(command))}")
            if change["upstream"]:
                out.append(f"    {linked(change['upstream']['what'])}")
    return "\n".join(out).rstrip() + "\n"


def changed_lines(entry: dict, pinned_entry: dict) -> list[tuple[str | None, str, str, int | None]]:
    """(context, line here, line on the pinned release, index of that line in the pinned
    transcript or None) for every printed line that changed. The context is the last line
    printed before the change without indentation, "" at the start of the output, None
    where only indented lines come before it."""
    mine, theirs = transcript({**entry, "raised": []}), transcript({**pinned_entry, "raised": []})
    found = []
    matcher = difflib.SequenceMatcher(a=mine, b=theirs, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        # "": the change is at the start of the output; None: only indented lines before it.
        context = next((line for line in reversed(theirs[:b0]) if line and not line[0].isspace()),
                       "" if b0 == 0 else None)
        for i in range(max(a1 - a0, b1 - b0)):
            found.append((context, mine[a0 + i].strip() if a0 + i < a1 else "(no line)",
                          theirs[b0 + i].strip() if b0 + i < b1 else "(no line)",
                          b0 + i if b0 + i < b1 else None))
    return found


def describe_difference(entry: dict, pinned_entry: dict, pinned: str) -> list[str]:
    """What a release's run does differently from the pinned one: one Markdown sentence per
    change, every message and printed line in code."""
    new_raised = [r for r in entry["raised"] if r not in pinned_entry["raised"]]
    per_rank = [(printed(a).splitlines(), printed(b).splitlines())
                for a, b in zip(entry["printed"], pinned_entry["printed"])]
    if new_raised and all(mine == theirs[:len(mine)] for mine, theirs in per_rank):
        # Stopped early, with the same output up to there: say where (rank 0's view).
        mine, theirs = per_rank[0]
        where = f"after printing {code(mine[-1])}" if mine else "before printing anything"
        instead = (f" ({pinned} prints {code(shortened(theirs[len(mine)]))} next)"
                   if len(mine) < len(theirs) else "")
        return [f"stops {where} with {code(raised)}{instead}" for raised in new_raised]
    theirs_lines = transcript({**pinned_entry, "raised": []})
    mine_notes, their_notes = footnotes_of(transcript(entry)), footnotes_of(theirs_lines)
    rows, printed_lines = [], {}  # printed_lines: what changed -> the contexts it changed under
    for context, here, there, index in changed_lines(entry, pinned_entry):
        header = table_header(theirs_lines, index) if index is not None else None
        sentence = row_change(here, there, header, mine_notes, their_notes, pinned) if header else None
        if sentence is not None:
            rows.append(sentence)
        else:
            where = printed_lines.setdefault(f"{code(here)} ({pinned}: {code(there)})", [])
            if context is not None and context != there and context not in where:
                where.append(context)
    lines = list(rows)
    by_contexts: dict[tuple, list[str]] = {}
    for what, contexts in printed_lines.items():
        by_contexts.setdefault(tuple(contexts), []).append(what)
    for contexts, whats in by_contexts.items():
        places = [p for p in contexts if p]
        under = " and ".join((["at the start"] if "" in contexts else [])
                             + ([f"under {', '.join(code(c) for c in places)}"] if places else []))
        lines.append(f"{under} prints {', '.join(whats)}" if under else f"prints {', '.join(whats)}")
    lines += [f"raises {code(raised)}" for raised in new_raised]
    lines += [f"does not raise {code(raised)} ({pinned} does)"
              for raised in pinned_entry["raised"] if raised not in entry["raised"]]
    if entry["ok"] != pinned_entry["ok"] and not new_raised:
        lines.append("the command " + ("succeeds" if entry["ok"] else "fails") + f" ({pinned}: the opposite)")
    return lines


def changes_of(data: dict, config: dict, command: str) -> list[dict]:
    """One entry per group of releases that differ from the pinned one in `command`: the
    releases as a span, when it changed, the sentences, the curated upstream change."""
    pinned = config["pinned"]
    ran = ran_releases(data, command)
    found = []
    for versions, entry in grouped(data, config)[command]:
        # The release after this run of releases prints something else: the pinned
        # release's output, or another group's.
        following = release_after(versions, ran)
        when = when_changed(versions[-1], following) if following else None
        exact = bool(when and when.startswith("changed in"))
        found.append({
            "span": span(versions, ran), "when": when,
            "sentences": describe_difference(entry, data["releases"][pinned]["examples"][command], pinned),
            "upstream": upstream_for(config, command, following) if exact else None,
        })
    return found


def change_line(change: dict, example: str | None = None) -> str:
    """One compact line per change: the releases (when it changed), the example, what differs."""
    when = f" ({change['when']})" if change["when"] else ""
    named = f", {code(Path(example).name)}" if example else ""
    line = f"**{change['span']}**{when}{named}: {'; '.join(change['sentences'])}."
    if change["upstream"]:
        line += f" Upstream: {linked(change['upstream']['change'])}."
    return line


def render_example_note(data: dict, config: dict, path: str) -> str:
    """A note for the pages that show `path`: the releases it ran on, and where its output differs."""
    pinned = config["pinned"]
    lines = []
    others = set()
    for command in commands(config):
        if example_name(command) != path:
            continue
        others.update(v for v in ran_releases(data, command) if v != pinned)
        for change in changes_of(data, config, command):
            lines.append(change_line(change))
    lines += package_lines(data, config, path)
    ran_on = (f"This example also ran on DeepSpeed {', '.join(sorted(others, key=release_key))}"
              if others else f"This example ran on DeepSpeed {pinned} only")
    head = (f'!!! note "Other DeepSpeed releases"\n    {ran_on} '
            f"([DeepSpeed versions](../versions.md)).")
    if package_runs(data, path):
        head += " It also ran with other versions of the packages named in bold (installed over the release's environment)."
    if not lines:
        return head + f" Every release printed the same as {pinned}.\n"
    return head + f" What differs from {pinned}:\n\n" + "".join(f"    - {line}\n" for line in lines)


def package_runs(data: dict, path: str) -> list[tuple[str, str, dict]]:
    """(release, key, entry) of every run of `path` with other package versions."""
    return [(version, key, entry)
            for version in sorted(data["releases"], key=release_key)
            for key, entry in data["releases"][version].get("with_packages", {}).items()
            if example_name(key) == path]


def package_lines(data: dict, config: dict, path: str) -> list[str]:
    """One line per run with other package versions: what differs from the pinned stack."""
    pinned = config["pinned"]
    lines = []
    for version, key, entry in package_runs(data, path):
        packages = parse_command(key)[0]
        label = f"**{version} with {', '.join(f'{name} {wanted}' for name, wanted in packages.items())}**"
        base = data["releases"].get(pinned, {}).get("examples", {}).get(plain_command(key))
        if base is None:
            continue
        if transcript(entry) == transcript(base):
            lines.append(f"{label}: printed the same as {pinned} with the pinned packages.")
            continue
        lines.append(f"{label}: {'; '.join(describe_difference(entry, base, pinned))}.")
    return lines


def note_name(path: str) -> str:
    """The generated note of an example: snippets/versions/<its name>.md."""
    return Path(path).stem + ".md"


def examples_with_differences(data: dict, config: dict) -> list[str]:
    """The examples (paths) whose output on some release differs from the pinned release's:
    each gets a note, which every page showing the example includes."""
    differing = {example_name(command) for command, groups in grouped(data, config).items() if groups}
    return sorted(differing | {example_name(key) for row in data["releases"].values()
                               for key in row.get("with_packages", {})})


def render(data: dict | None = None, config: dict | None = None) -> dict[str, str]:
    """Every generated file: versions.md, and a note per example with differences."""
    data = data or load_data()
    config = config or load_releases()
    files = {"versions.md": render_versions_page(data, config)}
    for path in examples_with_differences(data, config):
        files[note_name(path)] = render_example_note(data, config, path)
    return files


def write_generated(data: dict | None = None) -> None:
    GENERATED.mkdir(exist_ok=True)
    files = render(data)
    for name, text in files.items():
        (GENERATED / name).write_text(text)
    for stale in GENERATED.glob("*.md"):
        if stale.name not in files:
            stale.unlink()
