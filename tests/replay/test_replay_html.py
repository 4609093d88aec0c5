"""The replay's HTML report (fake vLLM servers): ``--html DIR`` writes an index and the viewer's
multiverse page of each diverging case; ``tensorverse report html`` builds the same report later
from the results file and the kept store; the case page works in a real browser (Debian's
headless Chromium through Playwright, as tests/viz does)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tensorverse.testing.fake_vllm import FakeVLLM
from tests.replay.test_replay_runner import corpus_dir, _replay  # type: ignore[import-not-found]  # noqa: F401

from tensorverse.cli import main as cli_main
from tensorverse.replay.html import case_page_name, diverging

CHROMIUM = os.environ.get("TENSORVERSE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def _data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="tv-data">(.*?)</script>', page, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1))


@pytest.fixture
def report(corpus_dir, tmp_path):  # noqa: F811 - the imported fixture, used
    """One replay of the 3-case corpus: ``ref`` and ``cand`` (another runtime: flips), kept store."""
    fakes = {"ref": FakeVLLM(), "cand": FakeVLLM(perturb=2.0)}
    out, store, html_dir = tmp_path / "res.json", tmp_path / "store", tmp_path / "report"
    res = _replay(corpus_dir, fakes, reference="ref", out=out, store=store, html=html_dir)
    return res, out, store, html_dir


def test_html_report_has_the_summary_and_a_multiverse_page_per_diverging_case(report):
    res, _, _, d = report
    index = (d / "index.html").read_text()
    assert res["html"] == str(d / "index.html")
    assert "Content-Security-Policy" in index and "<script" not in index
    for col in ("same_top_p", "flip_rate [95% CI]", "departures"):
        assert html.escape(col) in index
    div = {c["id"]: diverging(c, "ref") for c in res["cases"]}
    assert any(div.values())
    pages = sorted(p.name for p in (d / "cases").glob("*.html"))
    assert pages == sorted(case_page_name(cid) for cid, why in div.items() if why)
    for cid, why in div.items():
        row = re.search(rf'<tr data-case="{cid}" data-diverging="(\d)">(.*?)</tr>', index, re.S)
        assert row and row.group(1) == ("1" if why else "0")
        assert (f'href="cases/{case_page_name(cid)}"' in row.group(2)) == bool(why)
    # a case page is the viewer's export of that case: the basis as the trunk, every backend's runs
    cid = next(cid for cid, why in div.items() if why)
    case = next(c for c in res["cases"] if c["id"] == cid)
    page = (d / "cases" / case_page_name(cid)).read_text()
    data = _data(page)
    assert data["kind"] == "tensorverse-export" and data["session"]["session"]["id"] == case["session"]
    assert len(data["turns"]) == len(case["turns"])
    assert data["session"]["timeline"]["backends"] == ["ref", "cand"]
    turn = next(t for t in data["turns"].values() if t["turn"]["index"] == 0)
    assert turn["kind"] == "turn" and turn["turn"]["primary"] == "ref"  # the basis is the trunk
    assert turn["turn"]["tokens"] == case["turns"][0]["basis"]["tokens"]
    assert turn["forced"]["available"] is True
    flips = case["turns"][0]["backends"]["cand"]["forced"]["flips"]
    assert data["session"]["turns"][0]["backends"]["cand"]["forced_flips"] == len(flips)


def test_report_html_rebuilds_the_report_from_results_and_store(report, tmp_path, capsys):
    res, out, store, d = report
    again = tmp_path / "again"
    assert cli_main(["report", "html", str(out), "--store", str(store), "--out", str(again)]) == 0
    assert str(again / "index.html") in capsys.readouterr().out
    assert sorted(p.name for p in (again / "cases").glob("*.html")) == \
        sorted(p.name for p in (d / "cases").glob("*.html"))
    for p in (d / "cases").glob("*.html"):
        a, b = _data(p.read_text()), _data((again / "cases" / p.name).read_text())
        a.pop("generated_ns"), b.pop("generated_ns")
        assert a == b
    assert cli_main(["report", "html", str(store / "nope.json"), "--store", str(store),
                     "--out", str(again)]) == 2


@pytest.mark.browser
def test_case_page_renders_in_a_browser(report):
    import playwright.sync_api as pw

    assert Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}: run `make setup`"
    _, _, _, d = report
    page_path = next((d / "cases").glob("*.html"))
    with pw.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            pg = b.new_page()
            errors: list[str] = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            pg.goto(page_path.as_uri())
            pg.wait_for_selector("body[data-view=session]", timeout=15_000)
            assert "cand" in pg.locator("main").inner_text()
            pg.locator(".timeline .tl-cell").first.click()
            pg.wait_for_selector("body[data-view=turn]", timeout=15_000)
            assert pg.locator(".stream .tok").count() > 0
            assert errors == []
            pg.goto((d / "index.html").as_uri())
            assert "Cases (" in pg.locator("body").inner_text()
        finally:
            b.close()
