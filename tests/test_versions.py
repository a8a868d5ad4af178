"""The DeepSpeed version matrix (versions/): its data file, the pages rendered from it, and the
pinned release's row against a fresh run in this environment."""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest

from rankrun.runner import ROOT, documented_run

from versions import data, environments, markup, notes, outputs, plan

CONFIG = plan.load_releases()
DATA = data.load_data()
PINNED = CONFIG["pinned"]


def test_the_pinned_release_is_the_installed_one():
    assert PINNED == plan.pinned_in_constraints() == version("deepspeed")
    assert DATA["pinned"] == PINNED and DATA["torch"] == version("torch").split("+")[0]


def test_the_matrix_imports_only_the_standard_library():
    """tasks.py runs the matrix before anything is installed (versions/__init__.py): every
    module the command line imports, its own modules' imports too, is the standard library's,
    the package's own, or rankrun.project (standard library only as well)."""
    import ast
    import sys

    seen, todo, foreign = set(), ["versions.matrix"], []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for node in ast.walk(ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("versions."):
                    todo.append(name)
                elif name.split(".")[0] not in sys.stdlib_module_names and name != "rankrun.project":
                    foreign.append(f"{module}: {name}")
    assert foreign == [] and len(seen) > 1


def test_the_releases_list_covers_the_releases_the_pages_discuss():
    listed = plan.releases(CONFIG)
    # The latest of 0.14, 0.15, 0.17, 0.18; both sides of the two changes; the pinned one.
    for required in ("0.14.5", "0.15.4", "0.16.4", "0.16.5", "0.17.6", "0.18.9", "0.19.2",
                     "0.19.3", PINNED):
        assert required in listed


def test_every_release_that_ran_has_every_documented_command():
    """The pinned release has a result for every documented command, and every release whose
    import worked for every command planned on it; a listed release without results is shown
    as "not run yet"."""
    commands = plan.commands(CONFIG)
    assert len(commands) >= 6
    assert DATA["releases"][PINNED]["probe"]["ok"]
    assert plan.commands_for(PINNED, CONFIG) == commands
    for release, row in DATA["releases"].items():
        assert release in plan.releases(CONFIG), f"{release} is in the data but not in versions/releases.toml"
        if row["probe"]["ok"]:
            planned = plan.commands_for(release, CONFIG)
            assert sorted(row["examples"]) == sorted(planned), f"{release}: run python3 tasks.py matrix"
            assert row["env"] == {k: str(v) for k, v in CONFIG["releases"][release].get("env", {}).items()}
    table = (notes.GENERATED / "versions.md").read_text()
    for release in plan.releases(CONFIG):
        if release not in DATA["releases"]:
            assert re.search(rf"^\| {re.escape(release)} \| not run yet \|", table, re.M), release


def test_the_generated_files_are_rendered_from_the_data():
    for name, text in notes.render(DATA, CONFIG).items():
        path = notes.GENERATED / name
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: python3 tasks.py matrix --render"


def both_sides_ran(release: str, command: str) -> bool:
    """The data has `release` and the listed release before it, for `command`."""
    listed = plan.releases(CONFIG)
    before = listed[listed.index(release) - 1]
    return {before, release} <= set(data.ran_releases(DATA, command))


def test_each_upstream_change_is_where_the_data_shows_a_change():
    """Checked for every curated change whose release and the release before it have run;
    the versions page names an upstream change only when the data pins its release."""
    by_command = data.grouped(DATA, CONFIG)
    for item in CONFIG["upstream"]:
        command = next(c for c in plan.commands(CONFIG) if plan.example_name(c) == item["example"])
        if not both_sides_ran(item["release"], command):
            assert markup.linked(item["change"]) not in (notes.GENERATED / "versions.md").read_text()
            continue
        ran = data.ran_releases(DATA, command)
        followers = [notes.release_after(versions, ran) for versions, _ in by_command[command]]
        assert item["release"] in followers, f"the data shows no change in {item['example']} at {item['release']}"
        assert f"Upstream: {markup.linked(item['change'])}" in (notes.GENERATED / "versions.md").read_text()


def test_the_two_known_differences_are_in_the_data():
    """What the versions page shows (from the data): engine.module(...) without registration
    fails on every release that ran before 0.16.5 and works from 0.16.5 on; the registered
    ModuleZ3 weight is still gathered after backward on every release that ran before 0.19.3
    and released from 0.19.3 on."""
    changes = data.summary(DATA, CONFIG)

    def before(release, command):
        return {v for v in data.ran_releases(DATA, command) if plan.release_key(v) < plan.release_key(release)}

    detection = "torchrun --nproc_per_node 2 snippets/zero3/automatic_detection.py"
    rows = [per_release for (command, _, there), per_release in changes.items()
            if command == detection and "`engine.module(tokens)`" in there]

    def printed_the_table(release):  # (0.14.5 stops before printing anything)
        return "`engine.module(tokens)`" in "".join(DATA["releases"][release]["examples"][detection]["printed"])

    fails = {v for v in before("0.16.5", detection) if printed_the_table(v)}
    assert {"0.16.4", "0.15.4"} <= fails
    assert rows and all(set(row) - set(fails) == {v for v in row if not printed_the_table(v)} for row in rows)
    assert [row for row in rows if set(row) == fails] and all(
        "**fails** in step 0 (d) | works |" in line for row in rows for v, line in row.items() if v in fails)
    assert {"0.16.4", "0.16.5"} <= set(data.ran_releases(DATA, detection))  # both sides of the change ran
    printed = "".join(DATA["releases"]["0.16.4"]["examples"][detection]["printed"])
    assert "- (d) `RuntimeError: size mismatch, got input (10), mat (10x8), vec (0)`" in printed
    z3_command = "torchrun --nproc_per_node 2 snippets/zero3/module_z3.py"
    z3 = [(there, per_release) for (command, _, there), per_release in changes.items() if command == z3_command]
    assert z3 and all(set(per_release) == before("0.19.3", z3_command) for _, per_release in z3), z3
    assert {"0.19.2", "0.19.3"} <= set(data.ran_releases(DATA, z3_command))
    assert any("after engine.backward" in there and "NOT_AVAILABLE" in there for there, _ in z3)
    assert all("AVAILABLE" in line for _, per_release in z3 for line in per_release.values())


def test_differences_and_spans():
    entry = {"printed": ["a\n  x 1\nb\n  y 2\n"], "raised": []}
    pinned = {"printed": ["a\n  x 1\nb\n  y 3\n"], "raised": []}
    assert data.differences(entry, pinned) == [("b", "y 2", "y 3")]
    ran = ["0.14.5", "0.15.4", "0.16.4", "0.16.5", "0.19.8"]
    assert notes.release_after(["0.14.5", "0.15.4", "0.16.4"], ran) == "0.16.5"
    assert notes.release_after(["0.15.4"], ran) == "0.16.4"
    assert notes.release_after(["0.14.5", "0.16.4"], ran) is None  # not a consecutive run
    assert notes.release_after(["0.19.8"], ran) is None  # nothing after it
    assert notes.span(["0.14.5", "0.15.4", "0.16.4"], ran) == "0.14.5 to 0.16.4"


def test_an_abort_at_exit_is_a_failed_command():
    ranks = [{"printed": "done\n", "raised": None, "aborted_at_exit": True},
             {"printed": "", "raised": None, "aborted_at_exit": False}]
    assert outputs.compared({"ranks": ranks, "exit": 1, "timed_out": False})["ok"] is False
    ranks[0]["aborted_at_exit"] = False
    assert outputs.compared({"ranks": ranks, "exit": 0, "timed_out": False})["ok"] is True


def test_the_last_exception_of_a_rank_is_read_from_its_stderr():
    stderr = ("warning\n[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
              "[rank0]:     f()\n[rank0]: RuntimeError: mat2 must be a matrix\n")
    assert outputs.last_exception(stderr) == "RuntimeError: mat2 must be a matrix"
    # An object's address changes from run to run: the data keeps it as 0x….
    stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
              "TypeError: Signature mismatch between <function f at 0x7f3a60e32b60> and <function g at 0x7f3a57f05260>\n")
    assert outputs.last_exception(stderr) == "TypeError: Signature mismatch between <function f at 0x…> and <function g at 0x…>"
    # Terminal bold codes (torch's weights-only message has them) are not part of the message.
    stderr = "Traceback (most recent call last):\n  File \"x.py\"\nUnpicklingError: two options, \x1b[1mdo those\x1b[0m.\n"
    assert outputs.last_exception(stderr) == "UnpicklingError: two options, do those."


def test_a_rank_whose_peer_went_away_first_adds_no_cause():
    """gloo's message on the rank left behind names a port that changes from run to run."""
    gone = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4238. "
            "This is typically caused by a remote worker crashing.")
    ranks = [{"printed": "", "raised": "AttributeError: no attribute 'embed.weight'", "aborted_at_exit": False},
             {"printed": "", "raised": gone, "aborted_at_exit": False}]
    assert outputs.compared({"ranks": ranks, "exit": 1, "timed_out": False})["raised"] == [
        "AttributeError: no attribute 'embed.weight'"]
    ranks[0]["raised"] = None  # the only thing raised: kept
    assert outputs.compared({"ranks": ranks, "exit": 1, "timed_out": False})["raised"] == [gone]


def unqualified(line: str) -> str:
    """`torch.distributed.DistBackendError: m` -> `DistBackendError: m` (the runner keeps the short name)."""
    return re.sub(r"^(?:[\w]+\.)+(\w+:)", r"\1", line)


@pytest.mark.parametrize("command", plan.commands(CONFIG))
def test_the_pinned_row_equals_a_fresh_run(command):
    """The data's row for the pinned release is what the examples do now, in this environment:
    the command's run as the suite makes it once per session for every test that reads it
    (rankrun.runner.documented_run: the documented rank count is the command's)."""
    _, _, ranks, path = command.split(" ", 3)
    committed = DATA["releases"][PINNED]["examples"].get(command)
    assert committed is not None, f"no {PINNED} row for {command}: python3 tasks.py matrix --release {PINNED}"
    # A generous timeout: on a loaded machine a run can take minutes; a timeout fails the test.
    result = documented_run(path, timeout=600)
    assert result.world_size == int(ranks), f"{command} is not {path}'s documented run"
    assert not result.timed_out, result.failure_report()
    printed = [outputs.printed(rank.stdout) for rank in result.ranks]
    # The matrix keeps the last line of a traceback, without trailing spaces; so does this.
    raised = sorted({without_addresses(f"{rank.exception['name']}: {str(rank.exception['message']).splitlines()[0]}").rstrip()
                     for rank in result.ranks if rank.exception})
    report = f"versions/matrix.json's {PINNED} row is stale: python3 tasks.py matrix --release {PINNED}\n"
    assert printed == committed["printed"], report + result.failure_report()
    assert raised == sorted({unqualified(line) for line in committed["raised"]}), report + result.failure_report()
    assert result.ok == committed["ok"], report + result.failure_report()


def test_each_page_names_the_releases_its_examples_ran_on():
    """hooks/version_stamp.py: a page that includes a matrix example lists every other release it ran on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("versions_hook", ROOT / "hooks" / "version_stamp.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (ROOT / "docs" / "zero3" / "automatic-detection.md").read_text()
    expected = [v for v in data.ran_releases(DATA, "torchrun --nproc_per_node 2 snippets/zero3/automatic_detection.py")
                if v != PINNED]
    assert hook.releases_checked(page, DATA, CONFIG) == expected and expected
    # Two examples on one page: only the releases both ran on.
    both = ('--8<-- "snippets/zero3/automatic_detection.py"\n'
            '--8<-- "snippets/zero3/zero3_checkpoint.py"\n')
    common = (set(expected) & set(data.ran_releases(DATA, "torchrun --nproc_per_node 2 snippets/zero3/zero3_checkpoint.py")))
    assert hook.releases_checked(both, DATA, CONFIG) == sorted(common, key=plan.release_key)
    assert len(common) < len(expected)
    assert hook.releases_checked("no examples here", DATA, CONFIG) == []
    every = set()
    for command in plan.commands(CONFIG):
        every.update(data.ran_releases(DATA, command))
    versions_page = (ROOT / "docs" / "versions.md").read_text()
    assert hook.releases_checked(versions_page, DATA, CONFIG) == sorted(every - {PINNED}, key=plan.release_key)


# --- the generated notes, read as a browser gets them ---------------------------------------

from html.parser import HTMLParser  # noqa: E402

from rankrun.pages import pages_including, rendered  # noqa: E402
from rankrun.project import without_addresses  # noqa: E402

# What the notes and the versions page are made of; any other tag is a message's text that
# became HTML (an error's `<rank>` read as a tag).
NOTE_TAGS = {"div", "p", "ul", "li", "code", "a", "strong", "table", "thead", "tbody", "tr", "th", "td"}
# Markdown a reader should never see outside code: emphasis marks, backticks, table pipes, links.
STRAY_MARKDOWN = re.compile(r"\*|`|\||\]\(|\\")


class Reading(HTMLParser):
    """The tags of an HTML fragment, its text outside <code>, and the text of each <code>."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.outside, self.codes, self._depth = set(), [], [], 0

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag == "code":
            self._depth += 1
            self.codes.append("")

    def handle_endtag(self, tag):
        if tag == "code":
            self._depth -= 1

    def handle_data(self, data):
        if self._depth:
            self.codes[-1] += data
        else:
            self.outside.append(data)


def read_html(html: str) -> Reading:
    reading = Reading()
    reading.feed(html)
    return reading


def html_problems(html: str, name: str) -> list[str]:
    reading = read_html(html)
    problems = [f"{name}: a tag <{tag}> that no note makes (text read as HTML?)"
                for tag in sorted(reading.tags - NOTE_TAGS)]
    for text in reading.outside:
        for match in STRAY_MARKDOWN.finditer(text):
            around = text[max(0, match.start() - 40):match.end() + 40]
            problems.append(f"{name}: Markdown shown as text: {match.group(0)!r} in {around!r}")
    return problems


@pytest.mark.parametrize("name", sorted(notes.render(DATA, CONFIG)))
def test_a_generated_file_renders_without_raw_tags_or_stray_markdown(name):
    html = rendered((notes.GENERATED / name).read_text())
    assert html_problems(html, name) == []


def test_every_message_is_shown_whole_in_code_and_references_are_links():
    html = rendered((notes.GENERATED / "gathered_parameters.md").read_text())
    codes = read_html(html).codes
    # The error of 0.18.9 to 0.19.2 names `modifier_rank=<rank>`, with backticks of its own.
    assert any(code.startswith("RuntimeError: Cannot free a ZeRO-3 parameter") and
               "use `modifier_rank=<rank>` to broadcast" in code for code in codes), codes
    versions_page = rendered((notes.GENERATED / "versions.md").read_text())
    for item in CONFIG["upstream"]:
        repo, number = re.match(r"([\w.-]+/[\w.-]+)#(\d+)", item["change"]).groups()
        if item["change"] in (notes.GENERATED / "versions.md").read_text():
            assert f'<a href="https://github.com/{repo}/issues/{number}">{repo}#{number}</a>' in versions_page


def test_the_renderer_escapes_what_a_message_may_hold():
    """A made-up release whose run raises a message with every character Markdown or HTML
    would read (backticks, `<tag>`, `*`, `|`, `_`, a backslash) and prints a changed table row."""
    nasty = "RuntimeError: use `x=<rank>` | *not* __bold__ \\ [a](b) ``two``"
    pinned = {"printed": ["intro\n\n| Pattern | result |\n| --- | --- |\n| `a.b` | works |\n\n- (a) `E: one`\n"],
              "raised": [], "ok": True}
    other = {"printed": ["intro\n\n| Pattern | result |\n| --- | --- |\n| `a.b` | **fails** in step 0 (a) |\n\n"
                         "- (a) `E: one`\n"], "raised": [nasty], "ok": False}
    lines = notes.describe_difference(other, pinned, "9.9.9")
    html = rendered("".join(f"- {line}\n" for line in lines))
    assert html_problems(html, "made-up note") == []
    codes = read_html(html).codes
    assert nasty in codes and "E: one" in codes and "a.b" in codes, codes
    assert "column \u201cresult\u201d: fails in step 0 with" in " ".join(read_html(html).outside)


def test_the_site_shows_the_notes_without_raw_tags_or_stray_markdown():
    """The pages as the strict build made them: each generated note on each page that
    includes it, read from the built HTML."""
    from rankrun.site_build import strict_build

    result, site = strict_build()
    assert result.returncode == 0, result.stderr
    checked = 0
    for name in notes.render(DATA, CONFIG):
        for page in pages_including(f"snippets/versions/{name}"):
            html = (site / page.removeprefix("docs/").removesuffix(".md") / "index.html").read_text()
            if name == "versions.md":
                part = html.split('id="what-changes-between-releases"', 1)[1].split("<h2", 1)[0]
                part = part.split("</h2>", 1)[1]
            else:
                admonitions = re.findall(r'<div class="admonition note">\s*<p class="admonition-title">Other '
                                         r'DeepSpeed releases</p>.*?</div>', html, re.S)
                assert admonitions, f"{page} shows no note 'Other DeepSpeed releases'"
                part = "".join(admonitions)
            assert html_problems(part, f"{page} ({name})") == []
            checked += 1
    assert checked >= 6


def test_every_page_showing_an_example_that_differs_between_releases_includes_its_note():
    """An example whose run on some release differs from the pinned one (versions/matrix.json)
    has a generated note; every page that shows the example (a section of it or its output)
    includes that note."""
    differing = notes.examples_with_differences(DATA, CONFIG)
    assert {"snippets/zero3/gathered_parameters.py", "snippets/zero3/change_after_initialize.py",
            "snippets/zero3/module_z3.py"} <= set(differing)
    missing = []
    for path in differing:
        note = f"snippets/versions/{notes.note_name(path)}"
        showing = set(pages_including(path)) | set(pages_including(path.removesuffix(".py") + ".out"))
        assert showing, f"no page shows {path}"
        missing += [f"{page} shows {path} but not {note}" for page in sorted(showing - set(pages_including(note)))]
    assert not missing, "\n".join(missing)


def test_an_example_planned_on_some_releases_runs_there_and_on_the_pinned_one_only():
    config = {**CONFIG, "examples": ["snippets/zero3/module_z3.py",
                                     {"path": "snippets/zero3/zero3_checkpoint.py", "releases": ["0.14.5"]}]}
    subset = "torchrun --nproc_per_node 2 snippets/zero3/zero3_checkpoint.py"
    assert plan.planned_releases(subset, config) == ["0.14.5", PINNED]
    assert plan.planned_releases("torchrun --nproc_per_node 2 snippets/zero3/module_z3.py", config) \
        == plan.releases(CONFIG)
    assert subset in plan.commands_for("0.14.5", config)
    assert subset not in plan.commands_for("0.16.4", config)
    wrong = {**CONFIG, "examples": [{"path": "snippets/zero3/zero3_checkpoint.py", "releases": ["0.99.0"]}]}
    with pytest.raises(SystemExit, match=r"^versions/releases.toml: snippets/zero3/zero3_checkpoint.py "
                                         r"names releases it does not list: 0.99.0$"):
        plan.example_entries(wrong)


def test_runs_with_other_package_versions_are_planned_keyed_and_rendered():
    """An entry with `packages` is not a plain example (the pinned row's fresh-run test does not
    run it in this environment); it is planned on its releases (the pinned one by default), its
    key names the versions, it ran wherever planned on a release that ran, and the example's
    note names the versions in bold."""
    config = {**CONFIG, "examples": [
        "snippets/zero3/module_z3.py",
        {"path": "snippets/zero3/module_z3.py", "packages": {"peft": "0.8.2", "accelerate": "1.0.0"}},
        {"path": "snippets/zero3/module_z3.py", "releases": ["0.16.4"], "packages": {"peft": "0.9.0"}}]}
    assert plan.commands(config) == ["torchrun --nproc_per_node 2 snippets/zero3/module_z3.py"]
    key = "accelerate==1.0.0 peft==0.8.2 torchrun --nproc_per_node 2 snippets/zero3/module_z3.py"
    assert plan.package_commands_for(PINNED, config) == [key]
    assert plan.package_commands_for("0.16.4", config) == [
        "peft==0.9.0 torchrun --nproc_per_node 2 snippets/zero3/module_z3.py"]
    assert plan.parse_command(key) == ({"accelerate": "1.0.0", "peft": "0.8.2"}, 2,
                                       "snippets/zero3/module_z3.py")
    assert plan.plain_command(key) == plan.commands(config)[0]
    assert plan.example_name(key) == "snippets/zero3/module_z3.py"
    assert environments.overlay_dir(PINNED, {"peft": "0.8.2"}).name == f"{PINNED}+peft-0.8.2"
    for release, row in DATA["releases"].items():
        if row["probe"]["ok"] and row.get("examples"):
            planned = plan.package_commands_for(release, CONFIG)
            assert sorted(row.get("with_packages", {})) == sorted(planned), release
    generated = notes.render(DATA, CONFIG)
    for release, row in DATA["releases"].items():
        for key in row.get("with_packages", {}):
            packages, _, path = plan.parse_command(key)
            label = f"**{release} with " + ", ".join(f"{n} {v}" for n, v in packages.items()) + "**"
            assert label in generated[notes.note_name(path)], (release, key)
