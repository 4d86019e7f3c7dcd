"""The documentation site builds strictly, offline, and every page works in headless Chromium.

The site is built into a temporary folder with `mkdocs build --strict` (as `make docs`
does), served from 127.0.0.1, and each page is opened in Debian's Chromium: no console
error, every local link resolves to a built file, every image loads, and nothing is
fetched from anywhere but the local server (the network may be closed: a font or script
from a CDN would fail or leak).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import psycopg
import pytest

import pglock_celery
from pglock_celery import lock_key, try_lock
from tests.support.browser import chromium
from tests.support.services import wait_until
from tests.unit.test_readme import recipe

ROOT = Path(__file__).resolve().parents[2]
#: Where `PGLOCK_DOCS_SCREENSHOTS=1` writes the two screenshots the README shows.
SCREENSHOTS = {"index.html": "screenshot-home.png", "celery.html": "screenshot-celery.png"}
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,900",
)  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strictly into a folder of the test's own."""
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def pages(site: Path) -> list[str]:
    return sorted(
        str(page.relative_to(site))
        for page in site.rglob("*.html")
        if page.name != "404.html"  # served for a missing page only
    )


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on a free local port (search needs more than file://)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site))
    )
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Debian Chromium with a fresh profile, keeping the pages' console log."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    chrome = chromium([*CHROMIUM_FLAGS, f"--user-data-dir={profile}"], browser_log=True)
    try:
        yield chrome
    finally:
        chrome.quit()


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    """The pages the issue asks for, and the API reference of every public name."""
    built = set(pages(site))
    for page in (
        "index.html", "getting-started.html", "concepts.html", "strategies.html",
        "celery.html", "settings.html", "guarded-tables.html", "operations.html",
        "failover.html", "django.html", "migrating.html", "limits.html", "cli.html",
        "api.html",
    ):  # fmt: skip
        assert page in built, f"{page} was not built"
    api = (site / "api.html").read_text()
    for name in [*pglock_celery.__all__, "django.dsn"]:
        assert f'id="pglock_celery.{name}"' in api, f"the API reference lacks {name}"


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    """`make docs` is strict: the same configuration with one dead link does not build."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "limits.md").write_text(
        (docs / "limits.md").read_text() + "\n[gone](no-such-page.md)\n"
    )
    config = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
    (tmp_path / "mkdocs.yml").write_text(config)
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode != 0
    assert "no-such-page.md" in built.stderr + built.stdout


def local_target(site: Path, page_url: str, href: str, base: str) -> Path | None:
    """The built file a local href points at, or None for a link elsewhere."""
    absolute = urljoin(page_url, href)
    if not absolute.startswith(base):
        return None
    path = unquote(urlsplit(absolute).path)[len(urlsplit(base).path) :]
    target = site / path
    return target / "index.html" if target.is_dir() or not path else target


def test_every_page_loads_in_chromium_without_errors_broken_links_or_images(
    site: Path, served: str, browser: Any
) -> None:
    problems: list[str] = []
    shots = ROOT / "docs" if os.environ.get("PGLOCK_DOCS_SCREENSHOTS") == "1" else None
    for page in pages(site):
        url = urljoin(served, page)
        browser.get(url)
        state = browser.execute_script(
            """
            return {
              ready: document.readyState,
              title: document.title,
              links: Array.from(document.querySelectorAll('a[href]'), a => a.href),
              images: Array.from(document.images, i => [i.currentSrc || i.src,
                                 i.complete && i.naturalWidth > 0]),
              fetched: performance.getEntriesByType('resource').map(r => r.name),
            };
            """
        )
        if state["ready"] != "complete" or not state["title"]:
            problems.append(f"{page}: did not load ({state['ready']}, title {state['title']!r})")
        for entry in browser.get_log("browser"):
            if entry["level"] == "SEVERE":
                problems.append(f"{page}: console error: {entry['message']}")
        for href in state["links"]:
            if href.startswith(("mailto:", "javascript:")):
                continue
            target = local_target(site, url, href, served)
            if target is not None and not target.is_file():
                problems.append(f"{page}: broken link {href}")
            elif target is not None and "#" in href and target.suffix == ".html":
                anchor = href.split("#", 1)[1]
                if anchor and f'id="{anchor}"' not in target.read_text():
                    problems.append(f"{page}: broken anchor {href}")
        for src, loaded in state["images"]:
            if not loaded:
                problems.append(f"{page}: broken image {src}")
        for fetched in state["fetched"]:
            if not fetched.startswith(served):
                problems.append(f"{page}: fetched from outside the site: {fetched}")
        if shots is not None and page in SCREENSHOTS:
            browser.save_screenshot(str(shots / SCREENSHOTS[page]))
    print(f"\n{len(pages(site))} pages checked in Chromium")
    assert not problems, "\n".join(problems)


def test_no_page_names_a_resource_on_the_internet(site: Path) -> None:
    """Belt and braces for the browser check: no script, style, font or image URL
    outside the site in any built file (links to other sites are fine)."""
    remote = re.compile(
        r"""(<script[^>]+src=|<link[^>]+href=|<img[^>]+src=|url\()\s*["']?(https?:)?//""",
        re.IGNORECASE,
    )
    found = [
        f"{path.relative_to(site)}: {match.group(0)}"
        for path in site.rglob("*")
        if path.suffix in {".html", ".css", ".js"}
        for match in remote.finditer(path.read_text(errors="replace"))
    ]
    assert not found, "\n".join(found)


def test_the_running_recipe_sees_a_held_lock_without_taking_it(pg_dsn: str) -> None:
    """docs/migrating.md: a view asks whether a lock is held (holder()); asking never takes it."""
    running = recipe("running")["running"]
    names = [f"docs-running:{uuid.uuid4().hex[:8]}", "tenant:\u00e9\u00e9", "x" * 200]
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        for name in names:
            assert running(name, dsn=pg_dsn) is False
            # Another key with the same low 32 bits (objid) is not this lock.
            neighbour = lock_key(name) ^ (1 << 40)
            other.execute("SELECT pg_advisory_lock(%s)", (neighbour,))
            assert running(name, dsn=pg_dsn) is False
            other.execute("SELECT pg_advisory_unlock(%s)", (neighbour,))
            with try_lock(name, dsn=pg_dsn) as lock:
                assert lock.acquired
                assert running(name, dsn=pg_dsn) is True
                assert lock.held(), "asking must not disturb the holder"
            wait_until(lambda name=name: running(name, dsn=pg_dsn) is False, 10, "the release")
