"""MkDocs hook: under `mkdocs serve`, a rebuild does again only the work whose input changed.

`mkdocs serve` rebuilds the whole site after every edit, in the same process. Two steps take
most of a rebuild here (about 0.3 s and 0.6 s of 1.6 s) and give the same result for the same
input: highlighting a code block (pymdownx.highlight, Pygments) and splitting a page's HTML
into search entries (Material's search plugin). This hook remembers both results in the serve
process, keyed on everything they read, so after an edit only the edited page's new blocks and
that page's search entries are computed. A one-off `mkdocs build` computes everything once, as
without the hook (`on_startup` turns the caches on only for `serve`).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections import OrderedDict

ENTRIES = 4000  # results kept per cache; the least recently used go first


class Remembered:
    """A bounded least-recently-used mapping."""

    def __init__(self, size: int = ENTRIES):
        self.size, self.items = size, OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        if key in self.items:
            self.items.move_to_end(key)
            self.hits += 1
            return self.items[key]
        self.misses += 1
        return None

    def put(self, key, value):
        self.items[key] = value
        if len(self.items) > self.size:
            self.items.popitem(last=False)


HIGHLIGHTED = Remembered()
SEARCH_ENTRIES = Remembered()


def digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, default=repr, sort_keys=True).encode()).hexdigest()


def settings(highlighter) -> list:
    """The highlighter's plain settings (its other attributes, e.g. the Markdown instance, print
    with their address, which changes every rebuild)."""
    plain = (str, int, float, bool, type(None), list, tuple, dict)
    return sorted((name, value) for name, value in vars(highlighter).items() if isinstance(value, plain))


def remember_highlighting(highlight_class) -> None:
    original = highlight_class.highlight

    def highlight(self, src, language, *args, **kwargs):
        if kwargs.get("inline") or (len(args) > 5 and args[5]):  # inline code returns an element: not kept
            return original(self, src, language, *args, **kwargs)
        key = digest(settings(self), src, language, args, kwargs)
        html = HIGHLIGHTED.get(key)
        if html is None:
            html = original(self, src, language, *args, **kwargs)
            HIGHLIGHTED.put(key, html)
        return html

    highlight.remembers = True
    highlight_class.highlight = highlight


def headings(toc) -> list:
    """A page's table of contents as plain data (its objects print with their address)."""
    return [(item.title, item.url, item.level, headings(item.children)) for item in toc]


def remember_search_entries(index_class) -> None:
    original = index_class.add_entry_from_context

    def add_entry_from_context(self, page):
        key = digest(page.content, page.url, str(page.title), page.meta, headings(page.toc), self.config)
        entries = SEARCH_ENTRIES.get(key)
        if entries is None:
            before = len(self.entries)
            original(self, page)
            SEARCH_ENTRIES.put(key, copy.deepcopy(self.entries[before:]))
        else:
            self.entries.extend(copy.deepcopy(entries))

    add_entry_from_context.remembers = True
    index_class.add_entry_from_context = add_entry_from_context


def on_startup(command, dirty):
    if command != "serve":
        return
    from material.plugins.search.plugin import SearchIndex
    from pymdownx.highlight import Highlight

    if not getattr(Highlight.highlight, "remembers", False):
        remember_highlighting(Highlight)
    if not getattr(SearchIndex.add_entry_from_context, "remembers", False):
        remember_search_entries(SearchIndex)
