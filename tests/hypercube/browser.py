"""A hypercube site in Debian's headless Chromium (Playwright driver, never `playwright install`):
`open_site` opens ``SITE/index.html`` as ``file://``, waits for the app's rendered marker and,
on leaving, asserts that the page logged no console error or uncaught exception, opened no
dialog and requested nothing but ``file://`` URLs (the site works offline)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

CHROMIUM = os.environ.get("TENSORVERSE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@dataclass
class PageLog:
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    @property
    def off_disk(self) -> list[str]:
        return [u for u in self.requests if not u.startswith("file://")]


@contextmanager
def launch() -> Iterator[Any]:
    import playwright.sync_api as pw

    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"no Chromium at {CHROMIUM}: run `make setup` (apt-get install chromium)")
    with pw.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@contextmanager
def open_site(site: str | os.PathLike, *, browser: Any = None, log: PageLog | None = None, strict: bool = True,
              viewport: dict[str, int] | None = None) -> Iterator[Any]:
    """Yield a Playwright page on the site's index, rendered. ``browser``: reuse one (else one is
    launched); ``log``: filled with what the page did; ``strict``: assert it stayed clean."""
    log = log if log is not None else PageLog()
    with (launch() if browser is None else _same(browser)) as b:
        page = b.new_page(viewport=viewport or {"width": 1400, "height": 1000})
        page.set_default_timeout(15_000)
        page.on("console", lambda m: log.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: log.errors.append(f"pageerror: {e}"))
        page.on("request", lambda r: log.requests.append(r.url))

        def dialog(d: Any) -> None:
            log.dialogs.append(d.message)
            d.dismiss()

        page.on("dialog", dialog)
        try:
            page.goto((Path(site).resolve() / "index.html").as_uri())
            page.wait_for_selector("body[data-rendered='1']")
            yield page
            if strict:
                assert log.errors == [], log.errors
                assert log.dialogs == [], log.dialogs
                assert log.off_disk == [], log.off_disk
        finally:
            page.close()


@contextmanager
def _same(browser: Any) -> Iterator[Any]:
    yield browser
