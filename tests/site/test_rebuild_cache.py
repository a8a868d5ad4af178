"""hooks/rebuild_cache.py: under `mkdocs serve` a rebuild reuses highlighted code and search
entries whose input did not change, and the site it writes is the same byte for byte."""

from material.plugins.search.plugin import SearchIndex
from mkdocs.commands.build import build
from mkdocs.config import load_config
from pymdownx.highlight import Highlight

from rankrun.runner import ROOT


def build_in_this_process(site_dir, command):
    """One build as `mkdocs build` or as one rebuild of `mkdocs serve` does it; returns the hook."""
    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site_dir))
    config.plugins.on_startup(command=command, dirty=False)
    build(config)
    return config["hooks"]["hooks/rebuild_cache.py"]


def site_files(site_dir):
    return {path.relative_to(site_dir): path.read_bytes() for path in sorted(site_dir.rglob("*")) if path.is_file()}


def test_a_serve_rebuild_reuses_what_did_not_change_and_writes_the_same_site(tmp_path, monkeypatch):
    # The notebook page as an author's serve shows it: from the notebook cache (hooks/notebooks.py),
    # filled by the first build if need be. CI executes it on every build, and each run renders
    # other cell ids, so the page (rightly) misses the cache; that is not what this test is about.
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("NOTEBOOKS_EXECUTE", raising=False)
    originals = Highlight.highlight, SearchIndex.add_entry_from_context
    try:
        build_in_this_process(tmp_path / "plain", "build")
        assert (Highlight.highlight, SearchIndex.add_entry_from_context) == originals  # build: caches off
        hook = build_in_this_process(tmp_path / "first", "serve")
        assert hook.HIGHLIGHTED.misses > 100 and hook.SEARCH_ENTRIES.misses >= 12  # every block, every page
        first = [(cache.hits, cache.misses) for cache in (hook.HIGHLIGHTED, hook.SEARCH_ENTRIES)]
        build_in_this_process(tmp_path / "second", "serve")
        # Nothing changed: every code block and every page's entries came from the caches (a block
        # that stands twice in the site is a hit already in the first build).
        for cache, (hits, misses) in zip((hook.HIGHLIGHTED, hook.SEARCH_ENTRIES), first):
            assert cache.misses == misses
            assert cache.hits - hits == hits + misses
        plain = site_files(tmp_path / "plain")
        assert site_files(tmp_path / "first") == plain
        assert site_files(tmp_path / "second") == plain
    finally:
        Highlight.highlight, SearchIndex.add_entry_from_context = originals
