"""The built site loads nothing from other hosts: no scripts, styles, fonts, images or frames.

Plain links (<a href>) to upstream docs and issues are allowed; the browser tests check at run
time, from the network log, that no request leaves the local server.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import urlsplit

import pytest

from rankrun.site_build import built_pages

# Attributes that make a browser fetch something, per tag.
FETCHED = {
    "script": ["src"], "img": ["src", "srcset"], "source": ["src", "srcset"], "iframe": ["src"],
    "video": ["src", "poster"], "audio": ["src"], "embed": ["src"], "object": ["data"],
    "input": ["src"], "track": ["src"], "image": ["href", "xlink:href"], "use": ["href", "xlink:href"],
}
# <link rel=...> values that are not fetched (canonical points at the site's own address).
NOT_FETCHED_LINKS = {"canonical", "alternate", "prev", "next", "author", "license", "edit"}
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)|@import\s+['"]([^'"]+)""")
# An absolute URL in script code that loads a file (import(), fetch, a src string).
SCRIPT_LOAD = re.compile(r"""(?:import\(|fetch\(|src\s*=\s*)\s*['"`]((?:https?:)?//[^'"`]+)""")


def external(url: str) -> bool:
    url = url.strip()
    return bool(urlsplit(url).netloc) or url.startswith("//")


class AssetCollector(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.assets: list[str] = []
        self.inline: list[str] = []  # <style> and <script> bodies
        self._in = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in FETCHED.get(tag, []):
            if attrs.get(name):
                self.assets += [part.split()[0] for part in attrs[name].split(",") if part.strip()] \
                    if name == "srcset" else [attrs[name]]
        if tag == "link" and attrs.get("href"):
            if not set((attrs.get("rel") or "").lower().split()) <= NOT_FETCHED_LINKS:
                self.assets.append(attrs["href"])
        if attrs.get("style"):
            self.inline.append(attrs["style"])
        self._in = tag if tag in ("style", "script") else None

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in:
            self.inline.append(data)


def assets_of(html: str) -> list[str]:
    parser = AssetCollector()
    parser.feed(html)
    found = list(parser.assets)
    for code in parser.inline:
        found += [a or b for a, b in CSS_URL.findall(code)] + SCRIPT_LOAD.findall(code)
    return found


def test_the_scanner_finds_external_assets():
    # The scanner itself, on the kinds of reference it must catch and the ones it must allow.
    page = """
      <link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">
      <link rel="canonical" href="https://example.org/page/">
      <script src="https://unpkg.com/mermaid@11/dist/mermaid.min.js"></script>
      <img src="//cdn.example.org/x.png"> <img src="data:image/png;base64,AAAA">
      <style>@import "https://cdn.example.org/a.css"; b { background: url(https://x.org/i.png) }</style>
      <script>const m = await import("https://cdnjs.cloudflare.com/m.mjs")</script>
      <a href="https://github.com/deepspeedai/DeepSpeed">upstream</a>
    """
    assert [a for a in assets_of(page) if external(a)] == [
        "https://fonts.googleapis.com/css?family=Roboto", "https://unpkg.com/mermaid@11/dist/mermaid.min.js",
        "//cdn.example.org/x.png", "https://cdn.example.org/a.css", "https://x.org/i.png",
        "https://cdnjs.cloudflare.com/m.mjs",
    ]


def test_no_page_loads_anything_from_another_host(site_dir):
    pages = built_pages(site_dir)
    assert pages
    problems = {}
    for page in pages:
        remote = [a for a in assets_of(page.read_text()) if external(a)]
        if remote:
            problems[str(page.relative_to(site_dir))] = remote
    assert not problems


def test_no_stylesheet_loads_anything_from_another_host(site_dir):
    sheets = sorted(site_dir.rglob("*.css"))
    assert sheets
    problems = {}
    for sheet in sheets:
        remote = [a or b for a, b in CSS_URL.findall(sheet.read_text()) if external(a or b)]
        if remote:
            problems[str(sheet.relative_to(site_dir))] = remote
    assert not problems


def test_no_font_files_or_font_services(site_dir):
    # theme.font is false: the system's fonts are used, nothing is downloaded for them.
    text = "\n".join(p.read_text() for p in built_pages(site_dir))
    assert "fonts.googleapis.com" not in text and "fonts.gstatic.com" not in text


def test_mermaid_is_served_from_the_site_on_the_pages_with_diagrams(site_dir):
    assert (site_dir / "assets" / "vendor" / "mermaid" / "mermaid.min.js").stat().st_size > 1_000_000
    for page in built_pages(site_dir):
        html = page.read_text()
        loads = "assets/vendor/mermaid/mermaid.min.js" in html
        assert loads == ('<pre class="mermaid">' in html), page.relative_to(site_dir)


def test_notebook_pages_have_no_cdn_loaders(site_dir):
    html = (site_dir / "notebooks" / "gather-and-release" / "index.html").read_text()
    assert "cdnjs" not in html and "mathjax" not in html.lower() and "require.js" not in html


@pytest.fixture(scope="module")
def internal_links(site_dir):
    found = []
    for page in built_pages(site_dir):
        if page.name == "404.html":
            continue  # its links are absolute from site_url's path; the browser test follows them
        for href in re.findall(r'<a [^>]*href="([^"]+)"', page.read_text()):
            if not external(href) and not href.startswith(("#", "mailto:")):
                found.append((page, href))
    return found


def test_every_internal_link_points_at_a_file_of_the_site(site_dir, internal_links):
    assert len(internal_links) > 20
    broken = []
    for page, href in internal_links:
        target = (page.parent / urlsplit(href).path).resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file() or not target.is_relative_to(site_dir.resolve()):
            broken.append(f"{page.relative_to(site_dir)} -> {href}")
    assert not broken
