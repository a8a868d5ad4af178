"""The built site in a real Chromium: every page renders without errors and loads nothing from
other hosts; copy buttons copy the code; search finds the API names and lands on the right
page; the light/dark toggle works; the Mermaid diagram renders from the local copy; the 404
page helps.

Each test's tab records every request and every console error; the `browser_page` fixture
fails the test if a request left the local server or an error was logged.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from rankrun.pages import included_in_code_blocks, page_lines
from rankrun.project import ROOT

pytestmark = pytest.mark.slow  # a real Chromium

DOCS = ROOT / "docs"


def page_paths() -> list[str]:
    """The address (relative to the site root) of every page, from the sources in docs/."""
    paths = []
    for source in sorted(DOCS.rglob("*.md")) + sorted((DOCS / "notebooks").glob("*.py")):
        relative = source.relative_to(DOCS).with_suffix("").as_posix()
        # An index.md is its folder's address: docs/errors/index.md is errors/.
        paths.append(relative.removesuffix("index") if relative.split("/")[-1] == "index" else relative + "/")
    return paths


def source_of(path: str) -> Path:
    stem = DOCS / (path.rstrip("/") or "index")
    if (stem / "index.md").is_file():
        stem = stem / "index"
    return stem.with_suffix(".md") if stem.with_suffix(".md").is_file() else stem.with_suffix(".py")


def open_page(page, url):
    response = page.goto(url, wait_until="networkidle")
    assert response is not None and response.status == 200, f"{url}: {response and response.status}"
    return response


def test_every_built_page_is_checked(site_dir):
    built = {p.parent.relative_to(site_dir).as_posix() + "/" for p in site_dir.rglob("index.html")}
    built = {"" if p == "./" else p for p in built}
    built -= {p for p in built if p.startswith("assets/")}
    assert built == set(page_paths())


@pytest.mark.parametrize("path", page_paths(), ids=lambda p: p or "home")
def test_page_renders_with_working_copy_buttons(browser_page, site_url, path):
    page = browser_page
    open_page(page, site_url + path)
    # Waits (up to 30 s) for the title: on a loaded machine the page's scripts (Mermaid) may
    # still be laying it out when the network is idle.
    page.locator("article h1").first.wait_for(state="visible", timeout=30_000)
    stamp = page.locator("p.verified-with")
    assert stamp.is_visible()
    assert f"torch {version('torch')} and DeepSpeed {version('deepspeed')}" in " ".join(stamp.inner_text().split())

    source = source_of(path)
    if source.suffix == ".md":
        # Every code block has Material's copy button, and the blocks the page pulls from
        # snippets/ are there (an include can hold several sections, never fewer blocks).
        blocks = page.locator("article div.highlight pre")
        buttons = page.locator("article div.highlight pre button[data-md-type='copy']")
        assert blocks.count() == buttons.count()
        shown = " ".join(" ".join(blocks.all_text_contents()).split())  # collapsed blocks too
        for include, text in included_in_code_blocks(page_lines(source)):
            first_line = " ".join(next(line for line in text.splitlines() if line.strip()).split())
            assert first_line in shown, f"{path}: the code included by {include!r} is not on the page"
        if blocks.count():
            check_copy(page, blocks.first.locator("code"), buttons.first)
    else:
        # A notebook: every code cell has its copy button (mkdocs-jupyter's), and the plot is drawn.
        cells = page.locator(".jp-CodeCell .jp-InputArea-editor")
        buttons = page.locator(".jp-CodeCell clipboard-copy")
        assert cells.count() >= 3 and buttons.count() == cells.count()
        image = page.locator(".jp-OutputArea-output img")
        assert image.count() == 1
        assert image.evaluate("img => img.complete && img.naturalWidth > 300")
        check_copy(page, cells.nth(0).locator("pre"), buttons.nth(0))
        # The code blocks of its Markdown cells are Material's, with Material's copy button.
        blocks = page.locator("article .jp-MarkdownCell div.highlight pre")
        material_buttons = page.locator("article .jp-MarkdownCell div.highlight pre button[data-md-type='copy']")
        assert blocks.count() >= 1 and material_buttons.count() == blocks.count()
        check_copy(page, blocks.first.locator("code"), material_buttons.first)


def check_copy(page, code, button):
    page.evaluate("navigator.clipboard.writeText('')")
    button.scroll_into_view_if_needed()
    button.click()
    page.wait_for_function("async () => (await navigator.clipboard.readText()).length > 0")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied.split() == code.inner_text().split()


@pytest.mark.parametrize("query, lands_on", [
    ("register_external_parameter", "zero3/external-parameters/"),
    ("TiedLayerSpec", "pipeline/tied-layers/"),
])
def test_search_finds_the_api_and_lands_on_its_page(browser_page, site_url, query, lands_on):
    page = browser_page
    open_page(page, site_url)
    page.locator("label.md-search__icon[for='__search'], .md-search__input").first.click()
    page.locator("input.md-search__input").press_sequentially(query, delay=20)  # as typed
    # One list item per matching page; its first link is the page itself.
    documents = page.locator("li.md-search-result__item > a.md-search-result__link:first-child")
    documents.first.wait_for()
    page.wait_for_timeout(500)  # the results of the last keystroke replace those of earlier ones
    paths = [urlsplit(documents.nth(i).get_attribute("href")).path for i in range(documents.count())]
    target = "/" + lands_on
    assert target in paths[:3], f"{lands_on} is not among the first three results: {paths}"
    documents.nth(paths.index(target)).click()
    page.wait_for_load_state("networkidle")
    assert urlsplit(page.url).path == target
    assert query in page.locator("article").inner_text()


def test_light_dark_toggle(browser_page, site_url):
    page = browser_page
    open_page(page, site_url)
    body = page.locator("body")
    background = "() => getComputedStyle(document.body).backgroundColor"
    assert body.get_attribute("data-md-color-scheme") == "default"
    light = page.evaluate(background)
    page.locator("label[title='Switch to dark mode']").click()
    page.wait_for_function("document.body.getAttribute('data-md-color-scheme') === 'slate'")
    dark = page.evaluate(background)
    assert dark != light
    # The choice is kept when the reader moves to another page.
    open_page(page, site_url + "zero3/external-parameters/")
    assert body.get_attribute("data-md-color-scheme") == "slate"
    page.locator("label[title='Switch to light mode']").click()
    page.wait_for_function("document.body.getAttribute('data-md-color-scheme') === 'default'")
    assert page.evaluate(background) == light


def test_mermaid_diagram_renders_from_the_local_copy(browser_page, site_url):
    page = browser_page
    open_page(page, site_url + "pipeline/tied-layers/")
    page.wait_for_function("document.querySelectorAll('pre.mermaid').length === 0")
    diagram = page.locator("article div.mermaid")
    assert diagram.count() == 1
    assert diagram.bounding_box()["height"] > 100
    assert any(url.endswith("/assets/vendor/mermaid/mermaid.min.js") for url in page.requests)


def test_missing_page_gets_a_useful_404(browser_page, site_url):
    page = browser_page
    response = page.goto(site_url + "no/such/page/", wait_until="networkidle")
    assert response.status == 404
    # The browser logs the 404 status itself; that is the one error expected here.
    page.errors[:] = [e for e in page.errors if "status of 404" not in e]
    assert page.locator("article h1").inner_text() == "Page not found"
    assert page.locator("ul.not-found-pages a").count() == len(page_paths())
    # Styles loaded although the address is two levels deep: the header is laid out.
    assert page.locator("header.md-header").bounding_box()["height"] > 30
    page.locator("a.not-found-home").click()
    page.wait_for_load_state("networkidle")
    assert page.url == site_url



MIN_TEXT_PX = 12  # the smallest text of the plot, in CSS pixels as the reader sees it


# Code cells: each fits its box or scrolls sideways to its last column, and no box is cut off
# by what holds it. Reports every cell that does not.
CELLS_CLIPPED = """() => {
  const problems = [];
  document.querySelectorAll('.jp-CodeCell .highlight-ipynb').forEach((box, i) => {
    const right = box.getBoundingClientRect().right;
    for (let e = box.parentElement; e && e.tagName !== 'ARTICLE'; e = e.parentElement) {
      if (getComputedStyle(e).overflowX !== 'visible' && e.getBoundingClientRect().right < right - 1)
        problems.push(`cell ${i}: cut off by ${e.className}`);
    }
    if (box.scrollWidth > box.clientWidth) {
      if (!['auto', 'scroll'].includes(getComputedStyle(box).overflowX))
        problems.push(`cell ${i}: wider than its box and does not scroll`);
      box.scrollLeft = box.scrollWidth;
      if (box.scrollLeft + box.clientWidth < box.scrollWidth - 1)
        problems.push(`cell ${i}: its last column cannot be scrolled to`);
      box.scrollLeft = 0;
    }
  });
  return problems;
}"""


@pytest.mark.parametrize("width", [1400, 390], ids=["1400px", "phone-390px"])
def test_notebook_plot_and_code_are_readable(browser_page, site_url, width):
    """At a desktop width and a phone width: the whole plot fits the page without scrolling
    (its text size is checked with every other figure's, below), and no code cell is cut off at
    the right (at 1400 px none even needs scrolling)."""
    page = browser_page
    page.set_viewport_size({"width": width, "height": 900})
    open_page(page, site_url + "notebooks/gather-and-release/")
    image = page.locator(".jp-OutputArea-output img")
    assert image.count() == 1
    shown, box_width = image.evaluate(
        "img => [img.getBoundingClientRect().width, img.parentElement.clientWidth]")
    assert shown <= box_width + 1, "the plot is wider than the page's content"
    assert page.evaluate(CELLS_CLIPPED) == []
    if width >= 1000:
        widths = page.evaluate("() => [...document.querySelectorAll('.jp-CodeCell .highlight-ipynb')]"
                               ".map(b => b.scrollWidth - b.clientWidth)")
        assert widths and max(widths) <= 0, f"code cells need scrolling at {width} px: {widths}"


# The notebook page reads like the others: its text starts where every page's text starts, at
# the version stamp (no
# JupyterLab indentation), and its code cells and output have the background, font and keyword
# colour of the Material code blocks on the same page (not JupyterLab's).
NOTEBOOK_LOOK = """() => {
  const style = e => getComputedStyle(e);
  const left = e => Math.round(e.getBoundingClientRect().left);
  const title = document.querySelector('article p.verified-with');
  const material = document.querySelector('article .jp-MarkdownCell div.highlight pre > code');
  const cell = document.querySelector('article .jp-CodeCell .highlight-ipynb');
  const keyword = cell.querySelector('.kn, .k');
  const output = document.querySelector('article .jp-RenderedText pre');
  const probe = document.createElement('span');
  probe.style.color = 'var(--md-code-hl-keyword-color)';
  document.querySelector('article').append(probe);
  const want = style(probe).color;
  probe.remove();
  return {
    indented: [...document.querySelectorAll('article .jp-MarkdownCell p, article .jp-CodeCell .highlight-ipynb')]
      .map(left).filter(x => x !== left(title)),
    background: [style(material).backgroundColor, style(cell).backgroundColor, style(output).backgroundColor],
    font: [style(material).fontFamily, style(cell).fontFamily, style(output).fontFamily],
    keyword: [want, style(keyword).color],
  };
}"""


def test_the_notebook_page_looks_like_the_other_pages(browser_page, site_url):
    page = browser_page
    page.set_viewport_size({"width": 1400, "height": 900})
    open_page(page, site_url + "notebooks/gather-and-release/")
    look = page.evaluate(NOTEBOOK_LOOK)
    assert look["indented"] == [], f"notebook content not aligned with the title: {look['indented']}"
    assert len(set(look["background"])) == 1, look["background"]
    assert len(set(look["font"])) == 1, look["font"]
    assert look["keyword"][0] == look["keyword"][1], look["keyword"]


# --- the reading experience: widths and sizes as a reader's browser lays them out -----------

# Every code and output block of an article, collapsed ones opened first: how much wider its
# content is than its box (0 when it fits).
BLOCKS_OVER = """() => {
  document.querySelectorAll('article details').forEach(d => d.open = true);
  return [...document.querySelectorAll('article div.highlight pre > code')].map(code => {
    const lang = (code.closest('div.highlight').className.match(/language-(\\w+)/) || [])[1] || '';
    return [lang, code.scrollWidth - code.clientWidth, code.clientWidth,
            code.innerText.split('\\n').sort((a, b) => b.length - a.length)[0].slice(0, 80)];
  });
}"""


@pytest.mark.parametrize("path", [p for p in page_paths() if source_of(p).suffix == ".md"],
                         ids=lambda p: p or "home")
def test_at_1400_px_every_block_fits_its_column(browser_page, site_url, path):
    """At 1400 px the content column is wide (docs/assets/stylesheets/reading.css), Python
    blocks fit it (the snippets keep their lines short), and output and command blocks wrap
    their long lines: no block hides the end of a line off its right edge."""
    page = browser_page
    page.set_viewport_size({"width": 1400, "height": 900})
    open_page(page, site_url + path)
    blocks = page.evaluate(BLOCKS_OVER)
    assert all(width >= 800 for _, _, width, _ in blocks), f"{path}: a column narrower than 800 px: {blocks}"
    over = [(lang, excess, line) for lang, excess, _, line in blocks if excess > 1]
    assert not over, f"{path}: blocks wider than their column at 1400 px: {over}"


@pytest.mark.parametrize("width", [1400, 390], ids=["1400px", "phone-390px"])
def test_the_sharing_cost_plot_is_readable(browser_page, site_url, width):
    """The plot's smallest text is at least MIN_TEXT_PX CSS px high as shown (its font size,
    in the SVG's points, times the shown width over the SVG's width), and it fits the page."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sharing_cost_plot", ROOT / "hooks/sharing_cost_plot.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = browser_page
    page.set_viewport_size({"width": width, "height": 900})
    open_page(page, site_url + "zero3/sharing-cost/")
    image = page.locator("article picture img")
    assert image.count() == 1
    source, natural, shown, article = image.evaluate(
        "img => [img.currentSrc, img.naturalWidth, img.getBoundingClientRect().width,"
        " img.closest('article').getBoundingClientRect().width]")
    layout = next(name for name in hook.LAYOUTS if source.endswith("/" + name))
    _, _, _, points = hook.LAYOUTS[layout]
    text_px = points * 4 / 3 * shown / natural  # the SVG's units are points; a CSS px is 3/4 pt
    assert text_px >= MIN_TEXT_PX, f"{layout}: the plot's text is {text_px:.1f} px high at {width} px"
    assert shown <= article + 1


# Inline code in table cells: the width of every line of it but its last, in units of its font
# size (a monospace character is about 0.6 of it), for the code that spans several lines.
TABLE_CODE_LINES = """() => [...document.querySelectorAll('article td code')].map(code => {
  const em = parseFloat(getComputedStyle(code).fontSize);
  const rects = [...code.getClientRects()];
  return [code.textContent, rects.slice(0, -1).map(r => r.width / em)];
})"""


@pytest.mark.parametrize("path", [p for p in page_paths() if source_of(p).suffix == ".md"],
                         ids=lambda p: p or "home")
def test_at_390_px_code_in_a_table_cell_breaks_only_at_spaces(browser_page, site_url, path):
    """Inline code in a narrow table cell is not cut every few characters: a line of it that
    is not its last holds at least about 6 characters (4 em); the table scrolls sideways instead."""
    page = browser_page
    page.set_viewport_size({"width": 390, "height": 900})
    open_page(page, site_url + path)
    cut = [(text, widths) for text, widths in page.evaluate(TABLE_CODE_LINES) if any(w < 4 for w in widths)]
    assert not cut, f"{path}: code cut inside a word at 390 px: {cut[:5]}"


# Every figure of a page (an image, an inline SVG, a Mermaid diagram in its shadow root), as a
# 390 px wide screen shows it: the smallest text in CSS px (an SVG text's font size times the
# scale it is drawn at; an SVG image's text read from its source and scaled by its shown width
# over its own), whether something around it scrolls sideways, and whether it ends inside the
# article. A raster image has no measurable text: it is reported with `smallest` null.
FIGURES = """async () => {
  const article = document.querySelector('article');
  const right = article.getBoundingClientRect().right;
  const found = [];
  const scrollBox = el => {
    for (let e = el.parentElement; e && e !== article; e = e.parentElement) {
      const overflow = getComputedStyle(e).overflowX;
      if (['auto', 'scroll'].includes(overflow) && e.scrollWidth > e.clientWidth + 1) return e.className || e.tagName;
    }
    return null;
  };
  const texts = root => [...root.querySelectorAll('text, foreignObject *')].filter(
    e => [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim()));
  const svgs = [...article.querySelectorAll('svg')];
  article.querySelectorAll('div.mermaid').forEach(d => svgs.push(...d.shadowRoot.querySelectorAll('svg')));
  for (const svg of svgs) {
    const box = svg.getBoundingClientRect();
    if ((svg.parentElement && svg.parentElement.closest('svg')) || box.width < 100) continue;  // icons
    let smallest = Infinity, text = '';
    for (const t of texts(svg)) {
      const m = (t.closest('foreignObject') || t).getScreenCTM();
      const px = parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b);
      if (px < smallest) [smallest, text] = [px, t.textContent.trim().slice(0, 40)];
    }
    found.push({figure: 'svg', smallest, text, right: box.right, article: right, scroll: scrollBox(svg)});
  }
  for (const img of article.querySelectorAll('img')) {
    const box = img.getBoundingClientRect();
    if (box.width < 100) continue;
    const entry = {figure: img.currentSrc.slice(0, 60), smallest: null, right: box.right, article: right,
                   scroll: scrollBox(img)};
    const source = await (await fetch(img.currentSrc)).text();
    if (source.includes('<svg')) {
      const svg = new DOMParser().parseFromString(source, 'image/svg+xml').documentElement;
      const units = svg.viewBox.baseVal.width || parseFloat(svg.getAttribute('width'));
      entry.smallest = Infinity;
      for (const t of svg.querySelectorAll('text')) {
        const size = (t.getAttribute('style') || '').match(/font(?:-size)?:\\s*([\\d.]+)px/);
        const px = (size ? parseFloat(size[1]) : parseFloat(t.getAttribute('font-size'))) * box.width / units;
        if (px < entry.smallest) [entry.smallest, entry.text] = [px, t.textContent.trim().slice(0, 40)];
      }
    }
    found.push(entry);
  }
  return found;
}"""

# Material draws a Mermaid diagram in a closed shadow root; the test opens it to measure it.
OPEN_SHADOW_ROOTS = """(() => {
  const attach = Element.prototype.attachShadow;
  Element.prototype.attachShadow = function (init) { return attach.call(this, {...init, mode: 'open'}); };
})()"""


@pytest.mark.parametrize("path", page_paths(), ids=lambda p: p or "home")
def test_at_390_px_every_figure_is_readable_and_fits(browser_page, site_url, path):
    """On a phone (390 px), every figure's smallest text is at least MIN_TEXT_PX CSS px high,
    no figure sits in a box that scrolls sideways, and each ends inside the article."""
    page = browser_page
    page.add_init_script(OPEN_SHADOW_ROOTS)
    page.set_viewport_size({"width": 390, "height": 900})
    open_page(page, site_url + path)
    page.wait_for_function("document.querySelectorAll('pre.mermaid').length === 0")
    problems = []
    for figure in page.evaluate(FIGURES):
        if figure["smallest"] is None:
            problems.append(f"{figure['figure']}: a raster image, its text cannot be measured (use SVG)")
        elif figure["smallest"] < MIN_TEXT_PX:
            problems.append(f"{figure['figure']}: text {figure['smallest']:.1f} px ({figure.get('text')!r})")
        if figure["scroll"]:
            problems.append(f"{figure['figure']}: in a box that scrolls sideways ({figure['scroll']})")
        if figure["right"] > figure["article"] + 1:
            problems.append(f"{figure['figure']}: ends {figure['right'] - figure['article']:.0f} px past the article")
    assert not problems, f"{path} at 390 px: {problems}"
