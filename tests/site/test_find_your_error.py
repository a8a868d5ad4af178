"""The built "Find your error" and "What readers report, by cause" pages, and the search box.

The session's strict build (rankrun/site_build.py) is read as a reader gets it: every entry is
on the page, every link of both pages leads to a page and heading that exist, an entry with
several causes shows how to tell each, and the census shows the counts of the data (counted
here from the TOML files, not by the hook). Then one Chromium tab types each entry's message
into Material's search box, as a reader pasting it would, and the first result must be its
entry; the whole line a run printed must lead to an entry with the same fix. Material's search
worker, as built (hooks/search_fixes.py), also runs under Node to check that its index keeps
every word.
"""

from __future__ import annotations

import html
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

from rankrun import marks
from rankrun.project import DOCS, ROOT

pytestmark = marks.files


def hook(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "hooks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


DATA = hook("errors_pages").errors_data.load_valid(DOCS, ROOT)


class Page(HTMLParser):
    """The article of a built page: its ids, its links, and the text under each h3."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.ids, self.links, self.sections = set(), [], {}
        self._h3, self._current, self._in_article = None, None, False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "article":
            self._in_article = True
        if not self._in_article:
            return
        classes = (attrs.get("class") or "").split()
        if tag == "a" and attrs.get("href") and not {"headerlink", "md-content__button"} & set(classes):
            self.links.append(attrs["href"])
        if tag in ("h1", "h2", "h3"):
            self._h3 = [attrs.get("id"), tag, ""] if tag == "h3" else None
            self._current = None

    def handle_endtag(self, tag):
        if tag == "h3" and self._h3:
            anchor, _, text = self._h3
            self._current = anchor
            self.sections[anchor] = {"heading": " ".join(text.replace("¶", "").split()), "text": ""}
            self._h3 = None
        if tag == "article":
            self._in_article = False

    def handle_data(self, data):
        if self._h3:
            self._h3[2] += data
        elif self._current:
            self.sections[self._current]["text"] += data


def built(site: Path, path: str) -> Page:
    return Page((site / path).read_text())


def entry_anchors(site: Path) -> dict[str, str]:
    """Each entry's message or symptom -> the anchor of its heading on the built page."""
    return {section["heading"]: anchor for anchor, section in built(site, "errors/index.html").sections.items()}


def test_every_entry_is_a_heading_of_the_built_page(site_dir):
    headings = entry_anchors(site_dir)
    assert sorted(headings) == sorted(entry.key for entry in DATA.entries)


@pytest.mark.parametrize("path", ["errors/index.html", "errors/census/index.html"])
def test_every_link_leads_to_a_page_and_heading_that_exist(site_dir, path):
    page = built(site_dir, path)
    base = "http://site/" + path.removesuffix("index.html")
    internal = 0
    for href in page.links:
        url = urlsplit(urljoin(base, href))
        if url.netloc != "site":
            continue  # a thread's address: compared with the data below
        internal += 1
        target = site_dir / unquote(url.path).lstrip("/")
        target = target / "index.html" if target.is_dir() or not target.suffix else target
        assert target.is_file(), f"{path}: {href} leads to no page"
        if url.fragment:
            assert unquote(url.fragment) in built(site_dir, str(target.relative_to(site_dir))).ids, (
                f"{path}: {href}: {target.relative_to(site_dir)} has no heading {url.fragment!r}")
    answered = sum(1 for cause in DATA.causes.values() if cause.answer and not cause.proposed)
    assert internal >= (len(DATA.entries) if path == "errors/index.html" else answered)
    if "census" in path:
        external = [href for href in page.links if urlsplit(href).netloc]
        assert sorted(external) == sorted(thread.url for thread in DATA.threads)


def test_an_entry_with_several_causes_says_how_to_tell_each(site_dir):
    sections = built(site_dir, "errors/index.html").sections
    anchors = entry_anchors(site_dir)
    several = [entry for entry in DATA.entries if len(entry.causes) > 1]
    assert several
    for entry in several:
        text = " ".join(sections[anchors[entry.key]]["text"].split())
        assert text.count("How to tell:") == text.count("Cause:") == len(entry.causes), entry.key
        for cause in entry.causes:
            assert " ".join(cause.tell.split()) in text, (entry.key, cause.id)
        assert len({cause.section for cause in entry.causes}) == len(entry.causes), (
            f"{entry.key}: two of its causes link the same section; one entry per fix")


def test_the_census_page_counts_what_the_data_holds(site_dir):
    """Counted from the TOML files themselves, not by the hook's own functions."""
    causes = tomllib.loads((DOCS / "errors/causes.toml").read_text())["cause"]
    threads = [thread for path in sorted((DOCS / "errors/threads").glob("*.toml"))
               for thread in tomllib.loads(path.read_text())["thread"]]
    per_cause = Counter(thread["cause"] for thread in threads)
    repositories = {thread["id"].split("#")[0] for thread in threads if "#" in thread["id"]}
    forums = {thread["id"].split("/")[0] for thread in threads if "#" not in thread["id"]}
    page = built(site_dir, "errors/census/index.html")
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", (site_dir / "errors/census/index.html").read_text())).split())
    forum_words = f" and {len(forums)} forum{'s' * (len(forums) != 1)}" if forums else ""
    assert (f"{len(threads)} threads from {len(repositories)} repositories{forum_words}, under {len(causes)} causes; "
            f"{sum(1 for cause in causes if per_cause[cause])} of the causes have at least one thread.") in text
    statuses = Counter(cause["status"] for cause in causes.values())
    assert (f"Answered on this site: {statuses['run']} by a run, {statuses['source']} from upstream source only; "
            f"{statuses['unanswered']} not yet.") in text
    shown = {anchor: int(re.match(r"\s*(\d+) threads?\.", section["text"])[1])
             for anchor, section in page.sections.items()}
    assert shown == {cause: per_cause[cause] for cause in causes}
    assert list(shown.values()) == sorted(shown.values(), reverse=True)  # most threads first
    links = [href for href in page.links if urlsplit(href).netloc]
    assert len(links) == len(threads)


# --- the search box -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def search_tab(browser_context, site_url):
    """One tab for every query, its search box open; no request may leave the site, no error."""
    page = browser_context.new_page()
    requests, errors = [], []
    page.on("request", lambda request: requests.append(request.url))
    page.on("console", lambda message: message.type in ("error", "warning") and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(site_url, wait_until="networkidle")
    page.locator("label.md-search__icon[for='__search'], .md-search__input").first.click()
    page.errors = errors
    yield page
    page.close()
    assert not [url for url in requests if not url.startswith(site_url)]
    assert not errors, errors  # Material's worker logs "Invalid query" when lunr raises


def first_result(page, query: str) -> list[str]:
    """Type `query` into the search box; the first result's page and sections, in the order
    shown (`path#anchor`), once the list has stopped changing."""
    box = page.locator("input.md-search__input")
    box.fill("")
    box.press("End")
    page.wait_for_function("() => !document.querySelector('li.md-search-result__item')")
    box.fill(query)
    box.press("End")  # Material searches on keyup
    previous = None
    for _ in range(100):
        page.wait_for_timeout(150)
        links = page.eval_on_selector_all(
            "li.md-search-result__item:first-child > a.md-search-result__link", "as => as.map(a => a.href)")
        meta = page.locator(".md-search-result__meta").inner_text()
        if links and (links, meta) == previous:
            return [urlsplit(link).path.lstrip("/") + (f"#{urlsplit(link).fragment}" if urlsplit(link).fragment else "")
                    for link in links]
        previous = (links, meta)
    raise AssertionError(f"no results for {query!r}: {meta!r}; {page.errors}")


def first_section(results: list[str]) -> str:
    return next((result for result in results if "#" in result), results[0])


def entries_to_search():
    return [pytest.param(entry, id=entry.key[:70]) for entry in DATA.entries]


@pytest.mark.slow  # a real Chromium
@pytest.mark.parametrize("entry", entries_to_search())
def test_searching_for_the_message_lands_on_its_entry_first(search_tab, site_dir, entry):
    anchor = entry_anchors(site_dir)[entry.key]
    results = first_result(search_tab, entry.key)
    assert first_section(results) == f"errors/#{anchor}", results[:3]


def printed_lines():
    """Each message as a reader copies it where the entry quotes a stable beginning of it: the
    whole message its run printed, from the message to the end of the line (without the
    examples' ", raised in ..." note, or the end of a code span in a table or a version note)."""
    found = []
    for entry in DATA.entries:
        cause = next((cause for cause in entry.causes if cause.output), None)
        if entry.is_symptom or cause is None:
            continue
        line = next(line for line in (ROOT / cause.output).read_text().splitlines() if entry.key in line)
        whole = line[line.index(entry.key):].split(", raised in ", 1)[0]  # the examples' own note
        if "`" not in entry.key:
            whole = whole.split("`", 1)[0]  # the end of a code span in a table or a version note
        if whole != entry.key:
            found.append(pytest.param(entry, whole, id=whole[:70]))
    return found


def section_url(target: str) -> str:
    """`page.md#anchor` (relative to docs/) as the built site's `page/#anchor`."""
    page, _, anchor = target.partition("#")
    path = page.removesuffix(".md").removesuffix("index")
    path = path if path.endswith("/") or not path else path + "/"
    return path + (f"#{anchor}" if anchor else "")


@pytest.mark.slow  # a real Chromium
@pytest.mark.parametrize("entry, whole", printed_lines())
def test_searching_for_the_whole_printed_line_leads_to_the_same_fix(search_tab, site_dir, entry, whole):
    """The first result is the entry, or an entry or section that links the same fix (the
    message of DeepSpeed 0.19.8's "Cannot free" ends with the parameter summary that older
    releases raise alone, an entry of its own with the same fix)."""
    anchors = entry_anchors(site_dir)
    fixes = {cause.section for cause in entry.causes}
    same_fix = {f"errors/#{anchors[other.key]}" for other in DATA.entries
                if fixes & {cause.section for cause in other.causes}}
    result = first_section(first_result(search_tab, whole))
    assert result in same_fix | {section_url(fix) for fix in fixes}, (whole[:80], result)


# --- the search worker's index ---------------------------------------------------------------------

INDEX_CHECK = r"""
const fs = require("fs");
const [worker, index] = process.argv.slice(1);
let handler;
globalThis.self = globalThis;
globalThis.addEventListener = (type, listener) => { handler = listener; };
globalThis.postMessage = () => {};
globalThis.importScripts = () => {};
eval(fs.readFileSync(worker, "utf8"));
const build = lunr.TokenSet.fromArray;
const report = {};
lunr.TokenSet.fromArray = (words) => {
  const set = build(words), kept = new Set(set.toArray()), all = new Set(words);
  report.words = words.length;
  report.lost = words.filter((word) => !kept.has(word));
  report.invented = [...kept].filter((word) => !all.has(word));
  return set;
};
const data = JSON.parse(fs.readFileSync(index, "utf8"));
handler({ data: { type: 0, data: { config: data.config, docs: data.docs, options: {} } } })
  .then(() => console.log(JSON.stringify(report)));
"""


def index_words(worker: Path, index: Path) -> dict:
    done = subprocess.run([shutil.which("node"), "-e", INDEX_CHECK, str(worker), str(index)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_search_index_keeps_every_word(site_dir):
    """Material's worker as built (hooks/search_fixes.py) under Node, on the built index: the
    token set lunr searches holds exactly the words of the index."""
    if not shutil.which("node"):
        pytest.skip("no node on PATH (the install needs npm, which brings it)")
    worker = next(site_dir.glob("assets/javascripts/workers/search.*.min.js"))
    found = index_words(worker, site_dir / "search/search_index.json")
    assert found["words"] > 1000 and found["lost"] == [] and found["invented"] == [], found
