"""Fixtures for checking the built site: the strict build, a local server, a real Chromium.

The browser is Debian's Chromium at /usr/bin/chromium (`.ci/run` installs it); Playwright only
drives it and never downloads a browser. Without it the browser tests are skipped.
"""

from __future__ import annotations

import functools
import http.server
import os
import tempfile
import threading
from pathlib import Path

import pytest

from rankrun.site_build import strict_build

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="session")
def site_dir() -> Path:
    result, site = strict_build()
    assert result.returncode == 0, result.stderr
    return site


class SiteHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the built site like GitHub Pages does: 404.html for addresses that do not exist."""

    def log_message(self, format, *args):  # keep the test output clean
        pass

    def send_error(self, code, message=None, explain=None):
        page = Path(self.directory) / "404.html"
        if code != 404 or not page.is_file():
            return super().send_error(code, message, explain)
        body = page.read_bytes()
        self.send_response(404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


@pytest.fixture(scope="session")
def site_url(site_dir):
    """The built site served on 127.0.0.1 on a free port, at the root (as site_url's path is /)."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(SiteHandler, directory=str(site_dir)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def browser_context():
    """A fresh Chromium profile with clipboard access, shared by the browser tests."""
    if not CHROMIUM.is_file() or not os.access(CHROMIUM, os.X_OK):
        reason = (f"no Chromium at {CHROMIUM}: install it with `apt-get install chromium` "
                  "(.ci/run does) to run the browser tests")
        if os.environ.get("REQUIRE_BROWSER"):  # set by .ci/run: CI must not skip them
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright import sync_api
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile, sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
            permissions=["clipboard-read", "clipboard-write"],
        )
        context.set_default_timeout(20_000)
        yield context
        context.close()


@pytest.fixture
def browser_page(browser_context, site_url):
    """A new tab that records every request, console error and uncaught error.

    After the test: no request may have left the local server, and there must be no error.
    """
    page = browser_context.new_page()
    page.requests, page.errors = [], []
    page.on("request", lambda request: page.requests.append(request.url))
    page.on("console", lambda message: message.type == "error" and page.errors.append(f"console: {message.text}"))
    page.on("pageerror", lambda error: page.errors.append(f"uncaught: {error}"))
    yield page
    page.close()
    assert page.requests, "the page made no request at all"
    external = [url for url in page.requests if not url.startswith(site_url) and not url.startswith("data:")]
    assert not external, f"requests left {site_url}: {external}"
    assert not page.errors, page.errors
