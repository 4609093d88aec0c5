"""The sessions page leads with each shadow's verdict (issue 25): the API and a real browser."""

from __future__ import annotations

import httpx
import pytest

from tests.exporters.verdict_store import build_store
from tests.viz.viewer_thread import ARGS, CHROMIUM, serve_viewer


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("banner") / "store"
    build_store(d)
    return d


def test_api_verdict_matches_the_cli(store_dir, capsys):
    import json

    from tensorverse.cli import main

    assert main(["verdict", "--store", str(store_dir), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    with serve_viewer(store_dir) as url:
        got = httpx.get(url + "api/verdict", timeout=30).json()
    assert got == want


@pytest.mark.browser
def test_sessions_page_shows_a_banner_per_shadow(store_dir):
    import playwright.sync_api as playwright_api

    with serve_viewer(store_dir) as url, playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = b.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_selector("body[data-view=sessions]")
            page.wait_for_selector(".ship[data-backend=secondary]")
            bad = page.locator(".ship[data-backend=bad]")
            assert bad.get_attribute("data-decision") == "regression"
            assert "bad: regression" in bad.inner_text()
            assert "+25.00%" in bad.inner_text()  # 10 of 40 tool-calling turns broke, the floor's none
            good = page.locator(".ship[data-backend=good]")
            assert good.get_attribute("data-decision") == "undecided"
            assert "more tool-calling turns" in good.inner_text()
            assert "rgb(255, 227, 227)" == bad.evaluate("e => getComputedStyle(e).backgroundColor")
            assert errors == []
        finally:
            b.close()
