"""The data of "Find your error" and the census (docs/errors/), and what the build hook renders
from it (hooks/errors_pages.py, hooks/errors_data.py), without building the site.

On the site's own data: it is valid; every message of the troubleshooting page has an entry;
each entry's message is in an output file that the page of its section includes; the releases
it names are those of that run; a proposed cause is not in the census yet. On a made-up project
(tests/fixtures/errors_site/): what the pages show, and one clear problem for each way the data
can be wrong. The built pages, their links and the search box: tests/site/test_find_your_error.py.
"""

from __future__ import annotations

import html
import importlib.util
import re
import shutil
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from mkdocs.exceptions import PluginError

from rankrun import marks
from rankrun.pages import page_lines, page_outputs, rendered
from rankrun.project import DOCS, ROOT

pytestmark = marks.files

FIXTURE = ROOT / "tests/fixtures/errors_site"


def hook(name: str):
    """hooks/<name>.py, loaded by path as MkDocs loads it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "hooks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


pages = hook("errors_pages")
data_module = pages.errors_data
SITE = data_module.load_valid(DOCS, ROOT)  # raises DataError, with every problem, if the data is invalid


def entry_causes():
    return [pytest.param(entry, cause, id=f"{entry.key[:60]} [{cause.id}]")
            for entry in SITE.entries for cause in entry.causes]


# --- the site's own data -------------------------------------------------------------------------

def test_the_sites_data_has_entries_threads_and_causes():
    assert len(SITE.entries) >= 40 and len(SITE.threads) >= 100 and len(SITE.causes) >= 40
    assert any(len(entry.causes) > 1 for entry in SITE.entries)
    assert any(entry.is_symptom for entry in SITE.entries)


def test_every_message_of_the_troubleshooting_page_has_an_entry():
    """Find your error lists every message Troubleshooting explains (a longer entry, the whole
    message as printed, covers a heading that quotes its beginning), and its hangs."""
    text = (DOCS / "zero3/troubleshooting.md").read_text()
    messages = [m[1] for m in re.findall(r"^### (`+) ?(.+?) ?\1$", text, flags=re.M)]
    assert len(messages) >= 30
    keys = [entry.key for entry in SITE.entries]
    missing = [message for message in messages if not any(key.startswith(message) for key in keys)]
    assert not missing, f"add an [[entry]] to docs/errors/messages.toml for each of {missing}"
    assert any(entry.is_symptom and "generate()" in entry.key for entry in SITE.entries)


@pytest.mark.parametrize("entry, cause", entry_causes())
def test_each_message_is_in_an_output_that_the_page_of_its_section_includes(entry, cause):
    """The message (a symptom: its evidence) occurs verbatim in the output file a run wrote, and
    the page with the fix includes that file with --8<-- (the part it includes, for a section
    of a file); a cause read from source says so on the page instead."""
    page = DOCS / cause.section.partition("#")[0]
    if cause.source:  # the page quotes the message and says it was read from source
        assert "Read from source" in pages.render_entries(SITE, DOCS).split(entry.key, 1)[1].split("\n### ", 1)[0]
        text = " ".join(page.read_text().replace("\n", " ").split())
        assert entry.key.split(": ", 1)[-1] in text.replace("` `", " ").replace("`", "")
        assert re.search(r"from (its|the) source|read from source|by the source", text, flags=re.I)
        return
    shown = [text for spec, text in page_outputs(page_lines(page)) if spec.partition(":")[0] == cause.output]
    assert shown, f"{page.relative_to(ROOT)} does not include {cause.output}"
    wanted = cause.evidence if entry.is_symptom else entry.key
    assert any(wanted in text for text in shown), f"{wanted!r} is not in what {page.name} includes of {cause.output}"


VERSION = re.compile(r"(?P<name>[A-Za-z][\w-]*) (?P<versions>\d+\.\d+(?:\.\d+)?(?:(?:,| and| to) \d+\.\d+(?:\.\d+)?)*)")


def pinned() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if version:
            pins[name.strip().lower()] = version.strip()
    return pins


@pytest.mark.parametrize("entry, cause", entry_causes())
def test_the_releases_of_an_entry_are_those_of_its_run(entry, cause):
    """Every release an entry names is printed in its output file, or is the version
    constraints.txt pins (the suite's runs use exactly those), or the Python that runs them;
    for a message read from source, a release named on the page with the fix."""
    named = [(m["name"], version) for m in VERSION.finditer(cause.releases)
             for version in re.findall(r"\d+\.\d+(?:\.\d+)?", m["versions"])]
    assert named or cause.source, f"{cause.releases!r} names no release"
    # read from source: a release it names is one the page with the fix names
    output = (ROOT / cause.output if cause.output else DOCS / cause.section.partition("#")[0]).read_text()
    pins = pinned()
    python = ".".join(map(str, sys.version_info[:3]))
    for name, version in named:
        assert (re.search(rf"(?<![\d.]){re.escape(version)}(?![\d])", output)
                or pins.get(name.lower()) == version
                or (name == "Python" and (python + ".").startswith(version + "."))), (
            f"{entry.key[:60]}: {name} {version} is neither in {cause.output} nor pinned")


def test_a_proposed_cause_is_not_in_the_census_yet():
    """A cause proposed in messages.toml ([cause.<id>]) waits for the census; once
    docs/errors/causes.toml has it, the census's table is the one used, and the proposal goes."""
    proposed = tomllib.loads((DOCS / "errors/messages.toml").read_text()).get("cause", {})
    census = tomllib.loads((DOCS / "errors/causes.toml").read_text())["cause"]
    adopted = sorted(set(proposed) & set(census))
    assert not adopted, f"docs/errors/causes.toml names {adopted} now: remove their [cause.<id>] from messages.toml"


# --- a made-up project: what the pages show --------------------------------------------------------

@pytest.fixture
def project(tmp_path):
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    return tmp_path


def problems_of(root: Path) -> list[str]:
    data, problems = data_module.load(root / "docs", root)
    return problems or data_module.validate(data, root / "docs", root)


def test_the_made_up_project_is_valid(project):
    assert problems_of(project) == []


def test_find_your_error_lists_each_cause_with_how_to_tell_and_the_fix(project):
    data = data_module.load_valid(project / "docs", project)
    page = pages.render_entries(data, project / "docs")
    two = page.split("### `KeyError: 'lm_head.weight'`", 1)[1].split("\n### ", 1)[0]
    assert "Two cases give this message; **how to tell** says which one you have." in two
    assert "1. **Cause:** A weight read before anything gathered it" in two
    assert "    - **How to tell:** raised in the forward" in two
    assert "    - **Fix:** [A guide › The fix](../guide.md#the-fix)" in two
    assert "2. **Cause:** A save that writes tensors of size 0" in two
    assert "    - **How to tell:** raised while a file is loaded" in two
    assert "    - **Fix:** [A guide › Saving model\\.pt](../guide.md#saving)" in two
    assert "**Read from source**, not printed by a run here (the section says so): Transformers 4\\.40\\.0" in two
    one = page.split("### `RuntimeError: size mismatch", 1)[1].split("\n### ", 1)[0]
    assert "- **Cause:** A weight read before anything gathered it" in one and "How to tell" not in one
    assert "- **Printed by a run:** `snippets/run.out`, on DeepSpeed 0\\.19\\.8" in one
    assert "- **Readers' threads with this cause:** [2](census.md#read-too-early)" in one
    hang = page.split("### The run never ends on some ranks", 1)[1]
    assert "- **Cause:** Ranks that stop at different times" in hang  # a proposed cause
    assert "**Shown by a run:** `hung: rank 1 waits in all_gather` in `snippets/run.out`" in hang
    # grouped by exception, groups in alphabetical order, the symptoms last
    groups = re.findall(r"^## (.+?) \{ data-search-exclude \}$", page, flags=re.M)
    assert groups == ["KeyError", "RuntimeError", "No error: hangs and silent changes"]


def test_the_census_counts_threads_repositories_and_causes(project):
    data = data_module.load_valid(project / "docs", project)
    page = pages.render_census(data, project / "docs")
    assert page.startswith(
        "**4 threads** from 1 repository and 1 forum, under **3 causes**; 3 of the causes have at least one "
        "thread. Answered on this site: 1 by a run, 1 from upstream source only; 1 not yet.")
    order = re.findall(r"\{#([\w-]+)\}", page)
    assert order == ["read-too-early", "saved-empty", "not-yet"]  # most threads first; the proposed one is no census cause
    first = page.split("{#read-too-early}", 1)[1].split("\n### ", 1)[0]
    assert "**2 threads.** Answer: [A guide › The fix](../guide.md#the-fix) (a run shows it)." in first
    assert "- [octo/widgets\\#7](https://github.com/octo/widgets/pull/7) (pull): Gather before reading the head" in first
    assert "Symptom: the loss reads lm\\_head\\.weight outside the forward" in first
    assert "(read from upstream source, not run)" in page and "Answer: not answered yet." in page


@pytest.mark.parametrize("text", [
    "`fsdp` fails: *stars*, <b>tags</b> & [a link](x) #2",
    "RuntimeError: You set `ignore_mismatched_sizes` to `False`, thus raising an error.",
    "__init__ and **kwargs -> torch.Tensor != (cls: type[typing.Any]) 0x… {42}",
    "1. not a list + not a heading ! _under_ \\ back",
])
def test_text_and_code_render_as_exactly_the_text(text):
    """Titles, messages and paths from the data show as written: no emphasis, link or HTML."""
    def shown(markdown):
        return html.unescape(re.sub(r"<[^>]+>", "", rendered(markdown))).strip()
    assert shown(pages.plain(text)) == text
    assert shown(pages.code(text)) == text


# --- a made-up project: one problem at a time --------------------------------------------------------

BROKEN = [
    ("threads/octo-widgets.toml", 'cause = "saved-empty"', 'cause = "saved-emtpy"',
     "docs/errors/threads/octo-widgets.toml: thread 'octo/widgets#9': unknown cause 'saved-emtpy' "
     "(the causes are the tables of docs/errors/causes.toml)"),
    ("threads/forum.example.org.toml", 'id = "forum.example.org/t/tied-weights/42"\n', 'id = "octo/widgets#7"\n',
     "docs/errors/threads/octo-widgets.toml: thread 'octo/widgets#7': the same id is also in "
     "docs/errors/threads/forum.example.org.toml"),
    ("threads/octo-widgets.toml", 'path = "Trainer + ZeRO-3"\n', "",
     "docs/errors/threads/octo-widgets.toml: thread 'octo/widgets#9': missing field 'path'"),
    ("threads/octo-widgets.toml", 'path = "Trainer + ZeRO-3"\n', 'path = "Trainer"\nnote = "x"\n',
     "docs/errors/threads/octo-widgets.toml: thread 'octo/widgets#9': unknown field 'note' (allowed: id, kind, "
     "url, title, message, symptom, path, releases, cause)"),
    ("threads/octo-widgets.toml", 'symptom = "the loss reads lm_head.weight outside the forward"', 'symptom = ""',
     "docs/errors/threads/octo-widgets.toml: thread 'octo/widgets#7': give its `message` or, if it has none, "
     "its `symptom`"),
    ("threads/octo-widgets.toml", 'url = "https://github.com/octo/widgets/pull/7"',
     'url = "https://github.com/octo/widgets/issues/7"',
     "docs/errors/threads/octo-widgets.toml: thread 'octo/widgets#7': url 'https://github.com/octo/widgets/issues/7' "
     "is not its pull's address 'https://github.com/octo/widgets/pull/7'"),
    ("threads/forum.example.org.toml", 'id = "forum.example.org/t/tied-weights/42"', 'id = "octo/gadgets#3"',
     "docs/errors/threads/forum.example.org.toml: thread 'octo/gadgets#3': a GitHub thread's kind is issue, pull "
     "or discussion, not 'forum'"),
    ("causes.toml", 'answer = "guide.md#the-fix"', 'answer = "guide.md#the-fixes"',
     "docs/errors/causes.toml: cause 'read-too-early': 'guide.md#the-fixes': docs/guide.md has no heading with "
     "the anchor 'the-fixes' (its anchors: a-guide, saving, the-fix)"),
    ("causes.toml", 'answer = "guide.md#saving"', 'answer = "guides.md#saving"',
     "docs/errors/causes.toml: cause 'saved-empty': 'guides.md#saving': there is no page docs/guides.md"),
    ("causes.toml", 'status = "source"', 'status = "read"',
     "docs/errors/causes.toml: cause 'saved-empty': status 'read' is not one of run, source, unanswered"),
    ("causes.toml", 'status = "unanswered"', 'status = "run"',
     "docs/errors/causes.toml: cause 'not-yet': status 'run' needs an answer (\"page.md#anchor\")"),
    ("messages.toml", 'id = "saved-empty"', 'id = "saved-emtpy"',
     "docs/errors/messages.toml: entry \"KeyError: 'lm_head.weight'\", cause 'saved-emtpy': unknown cause"),
    ("messages.toml", 'tell = "raised in the forward"\n', "",
     "docs/errors/messages.toml: entry \"KeyError: 'lm_head.weight'\", cause 'read-too-early': the message has 2 "
     "causes; say in `tell` how a reader tells this one from the others"),
    ("messages.toml", 'message = "KeyError: \'lm_head.weight\'"', 'message = "KeyError: \'lm_head\'"',
     "docs/errors/messages.toml: entry \"KeyError: 'lm_head'\", cause 'read-too-early': snippets/run.out does not "
     "contain \"KeyError: 'lm_head'\" verbatim"),
    ("messages.toml", 'id = "proposed-hang"', 'id = "not-yet"',
     "docs/errors/messages.toml: entry 'The run never ends on some ranks', cause 'not-yet': the cause has no answer "
     "yet; give `section`, or leave the cause out of this entry until its section exists"),
    ("messages.toml", 'evidence = "hung: rank 1 waits in all_gather"\n', "",
     "docs/errors/messages.toml: entry 'The run never ends on some ranks', cause 'proposed-hang': a symptom needs "
     "`evidence`, the line of snippets/run.out that shows it"),
    ("messages.toml", 'source = true\n', "",
     "docs/errors/messages.toml: entry \"KeyError: 'lm_head.weight'\", cause 'saved-empty': give `output` (the file "
     "a run printed it in) or `source = true`"),
    ("messages.toml", 'symptom = "The run never ends on some ranks"\n',
     'symptom = "The run never ends on some ranks"\nmessage = "hung"\n',
     "docs/errors/messages.toml: entry 'hung': give either `message` (exactly as a run printed it) or `symptom`, "
     "not both"),
    ("messages.toml", 'section = "guide.md#saving"', 'section = "guide.md#saved"',
     "docs/errors/messages.toml: entry \"KeyError: 'lm_head.weight'\", cause 'saved-empty': 'guide.md#saved': "
     "docs/guide.md has no heading with the anchor 'saved'"),
    ("messages.toml", '[[entry]]\nsymptom', '[[entry]]\nmessage = "KeyError: \'lm_head.weight\'"\n'
     '[[entry.cause]]\nid = "read-too-early"\noutput = "snippets/run.out"\nreleases = "x 1.0"\n[[entry]]\nsymptom',
     "docs/errors/messages.toml: entry \"KeyError: 'lm_head.weight'\": a second entry for the same message"),
    ("causes.toml", '[cause.not-yet]', '[cause.not-yet',
     "docs/errors/causes.toml: not valid TOML: "),
]


@pytest.mark.parametrize("file, old, new, problem", BROKEN, ids=[case[3][:70] for case in BROKEN])
def test_each_kind_of_invalid_data_is_named_in_one_clear_line(project, file, old, new, problem):
    path = project / "docs/errors" / file
    assert old in path.read_text(), "the case no longer matches the made-up project"
    path.write_text(path.read_text().replace(old, new, 1))
    found = problems_of(project)
    assert any(line.startswith(problem) for line in found), found


def test_invalid_data_stops_the_build_with_every_problem(project):
    for file, old, new in [("causes.toml", 'status = "source"', 'status = "read"'),
                           ("threads/octo-widgets.toml", 'cause = "saved-empty"', 'cause = "nope"')]:
        path = project / "docs/errors" / file
        path.write_text(path.read_text().replace(old, new, 1))
    config = SimpleNamespace(docs_dir=str(project / "docs"), config_file_path=str(project / "mkdocs.yml"))
    with pytest.raises(PluginError) as stopped:
        pages.on_pre_build(config)
    lines = str(stopped.value).splitlines()
    assert lines[0] == "2 problem(s) in docs/errors/, the data of \"Find your error\" and the census:"
    assert [line.split(": ")[:2] for line in lines[1:]] == [
        ["  - docs/errors/causes.toml", "cause 'saved-empty'"],
        ["  - docs/errors/threads/octo-widgets.toml", "thread 'octo/widgets#9'"],
    ]


def test_a_page_without_its_marker_stops_the_build(project):
    config = SimpleNamespace(docs_dir=str(project / "docs"), config_file_path=str(project / "mkdocs.yml"))
    pages.on_pre_build(config)
    page = SimpleNamespace(file=SimpleNamespace(src_uri="errors/census.md"))
    rendered_census = pages.on_page_markdown(f"# Census\n\n{pages.MARKERS['errors/census.md']}\n", page, config, None)
    assert "**4 threads**" in rendered_census
    with pytest.raises(PluginError, match="docs/errors/census.md has lost its marker line"):
        pages.on_page_markdown("# Census\n", page, config, None)
