"""The viewer in a real browser: Playwright driving Debian's headless Chromium.

Needs ``apt-get install chromium`` (``/usr/bin/chromium``; override with TENSORVERSE_CHROMIUM) and
``pip install playwright`` (never ``playwright install``: the browser is Debian's); `make setup`
installs both, so a missing one fails the tests instead of hiding them. Screenshots go to ``out/test-artifacts/viz/`` (or $TENSORVERSE_ARTIFACTS).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.viz.viewer_thread import ARGS, CHROMIUM, serve_viewer

pytestmark = pytest.mark.browser

ARTIFACTS = Path(os.environ.get("TENSORVERSE_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "out" / "test-artifacts" / "viz"))

import playwright.sync_api as playwright_api  # noqa: E402

if not Path(CHROMIUM).exists():
    raise RuntimeError(f"no Chromium at {CHROMIUM}: run `make setup` (apt-get install chromium)")


@pytest.fixture(scope="module")
def server(built):
    """The viewer on a free loopback port, in a thread of its own (every top-k panel fetched per
    position, as for a long turn; the export test below covers panels carried in the view)."""
    with serve_viewer(built.path) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


class Watched:
    """A page that records console errors, uncaught exceptions and dialogs (alerts)."""

    def __init__(self, browser) -> None:
        self.page = browser.new_page(viewport={"width": 1500, "height": 1000})
        self.page.set_default_timeout(15_000)
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("dialog", self._dialog)

    def _dialog(self, d) -> None:
        self.dialogs.append(d.message)
        d.dismiss()

    def open(self, url: str, view: str) -> None:
        self.page.goto(url)
        self.page.wait_for_selector(f"body[data-view={view}]")

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.page.close()


@pytest.fixture()
def page(browser):
    w = Watched(browser)
    yield w
    w.close()


def _fmt_p(p: float) -> str:
    """The app's fmtP for p >= 0.0995."""
    return f"{p * 100:.1f}%"


def test_forced_flips_topk_and_keyboard(server, page, ro_store, vz):
    from tensorverse.viz.data import ViewData

    tv = ViewData(ro_store).turn_view("s-net-t1", inline_panels=True)
    pg = page.page
    page.open(server + "#/t/s-net-t1?mode=forced", "turn")
    flips = pg.locator(".stream .tok.flip")
    assert flips.count() == 3
    assert [int(x) for x in flips.evaluate_all("els => els.map(e => e.dataset.p)")] == \
        [vz.FP8_FLIP, vz.FA2_FLIP, vz.FP8_VLAN_FLIP]
    # one dot per flipping backend
    assert pg.locator(f'.stream .tok[data-p="{vz.FA2_FLIP}"] .dot').count() == 1
    # the KL sparkline: one lane per compared backend
    assert pg.locator(".sparks .spark").count() == 3

    pg.locator(f'.stream .tok[data-p="{vz.FA2_FLIP}"]').click()
    table = pg.locator("#topk table.topktable")
    table.wait_for()
    heads = table.locator("thead tr").first.locator(".chip").all_inner_texts()
    assert heads == ["secondary", "primary", "fa2", "fp8"]  # reference first
    panel = tv["forced"]["panels"][vz.FA2_FLIP]
    rows = table.locator("tbody tr")
    assert rows.count() == len(panel["ids"])
    first_row = rows.nth(0).locator("td").all_inner_texts()
    assert first_row[0] == "0"
    names = [b["name"] for b in tv["backends"]]
    fa2 = [names[i] for i in panel["m"]].index("fa2")
    fa2_p_of_1 = panel["p"][fa2][panel["ids"].index(vz.tok("1"))]
    second_row = rows.nth(1)
    assert second_row.locator("td").first.inner_text() == "1"
    fa2_cell = second_row.locator(".pcell").nth(fa2)
    assert fa2_cell.locator(".pv").inner_text() == _fmt_p(fa2_p_of_1)
    assert fa2_cell.locator(".rk").inner_text() == "#0"
    assert "emitted" not in (fa2_cell.get_attribute("class") or "")  # forced: fa2 emitted "0"
    # forced runs all emit the primary's token; fa2's own choice is named in the position info
    assert "flips to" in pg.locator("#topk .posinfo").inner_text()
    page.shot("forced-flip-topk")

    sel = lambda: int(pg.locator(".stream .tok.sel").get_attribute("data-p"))  # noqa: E731
    assert sel() == vz.FA2_FLIP
    pg.keyboard.press("n")
    assert sel() == vz.FP8_VLAN_FLIP
    pg.keyboard.press("p")
    pg.keyboard.press("p")
    assert sel() == vz.FP8_FLIP
    pg.keyboard.press("ArrowRight")
    assert sel() == vz.FP8_FLIP + 1
    assert f"p={vz.FP8_FLIP + 1}" in pg.url
    assert page.errors == [] and page.dialogs == []


def test_free_multiverse_branches_hover_and_toolcalls(server, page, vz):
    pg = page.page
    page.open(server + "#/t/s-net-t1?mode=free", "turn")
    assert pg.locator(".stream .lane.node").count() == 5  # root, 2 x 2 branches
    assert pg.locator(".stream .ended").count() == 3  # three distinct outputs
    assert pg.locator(".stream .tok.flip").count() == 4  # each option's first token
    heads = pg.locator(".stream .lanehead").all_inner_texts()
    assert any("branch @35" in h and "fa2" in h for h in heads)
    assert any("branch @2" in h and "fp8" in h for h in heads)

    fa2_flip = pg.locator(f'.stream .tok.flip[data-p="{vz.FA2_FLIP}"]:not(.refbranch)')
    fa2_flip.hover()
    pg.wait_for_selector("#topk table.topktable")
    assert f"Position {vz.FA2_FLIP}" in pg.locator("#topk h2").inner_text()
    members = pg.locator("#topk thead tr").first.locator(".chip").all_inner_texts()
    assert members == ["secondary", "primary", "fa2"]  # the group that shared the context
    assert "branch point" in pg.locator("#topk .posinfo").inner_text()

    # keyboard: the two non-reference branch points, in order
    pg.keyboard.press("n")
    first = pg.locator(".stream .tok.sel")
    assert int(first.get_attribute("data-p")) == vz.FP8_FLIP
    pg.keyboard.press("n")
    assert int(pg.locator(".stream .tok.sel").get_attribute("data-p")) == vz.FA2_FLIP

    cards = pg.locator("#toolcalls .toolcard")
    assert cards.count() == 3
    fa2_card = cards.filter(has_text="value_mismatch")
    assert fa2_card.count() == 1
    assert fa2_card.locator("tr.argdiff .argk").inner_text() == "interface"
    marks = fa2_card.locator("mark").all_inner_texts()
    assert "1/4" in marks and "0/1.201" in marks
    page.shot("free-multiverse")
    pg.keyboard.press("f")
    pg.wait_for_selector('.modes .mode[data-mode="forced"][aria-selected="true"]')
    assert page.errors == [] and page.dialogs == []


def test_sessions_list_and_timeline(server, page):
    pg = page.page
    page.open(server, "sessions")
    assert pg.locator("table.sessions tbody tr").count() == 9
    pg.locator("input[type=search]").first.fill("netops")
    pg.locator("form.filters button").click()
    # (no wait_for_function: its string predicate is eval, which the viewer's CSP forbids)
    pg.wait_for_selector("table.sessions tbody tr:nth-child(2)", state="detached")
    assert pg.locator("table.sessions tbody tr").count() == 1
    pg.locator("table.sessions tbody tr a").first.click()
    pg.wait_for_selector("body[data-view=session]")
    cells = pg.locator(".timeline .tl-cell.first")
    assert cells.count() == 2  # fa2 and fp8 first diverged in turn 1
    page.shot("session-timeline")
    cells.first.click()
    pg.wait_for_selector("body[data-view=turn]")
    assert page.errors == [] and page.dialogs == []


def test_xss_corpus_stays_inert(server, page, built, tmp_path, vz):
    pg = page.page
    for url, view in [(server, "sessions"), (server + "#/s/s-xss", "session"),
                      (server + "#/t/s-xss-t0?mode=forced", "turn"), (server + "#/t/s-xss-t0?mode=free", "turn")]:
        page.open(url, view)
        if view == "turn":
            pg.locator(".stream .tok.flip").first.click()
        pg.wait_for_timeout(100)
        assert pg.locator("img").count() == 0
        assert pg.evaluate("document.querySelectorAll('main script').length") == 0
        text = pg.locator("main").inner_text()
        assert vz.XSS_IMG in text or vz.XSS_BACKEND in text, url
    assert vz.XSS_SCRIPT in pg.locator("main").inner_text()
    page.shot("xss-inert")

    from tensorverse.cli import main

    out = tmp_path / "xss.html"
    assert main(["export", "html", "--session", "s-xss", "--out", str(out), "--store", str(built.path)]) == 0
    page.open(out.as_uri(), "session")
    assert vz.XSS_IMG in pg.locator("main").inner_text()
    pg.locator(".timeline .tl-cell").first.click()
    pg.wait_for_selector("body[data-view=turn]")
    pg.locator(".stream .tok.flip").first.click()
    pg.wait_for_selector("#topk table.topktable")
    assert pg.locator("img").count() == 0
    page.shot("export-xss")
    assert page.dialogs == []
    assert page.errors == []


def test_flip_classes_legend_filter_and_branch_header(server, page, vz):
    """Issue 19: every flip shows its class (from the stored comparisons), the legend explains
    the classes, a filter keeps one class, the branch header names the class, and the turn head
    shows the primary's parser check."""
    pg = page.page
    page.open(server + "#/t/s-net-t1?mode=forced", "turn")
    legend = pg.locator(".legend")
    assert legend.locator(".fclass").all_inner_texts() == ["tie", "near tie", "noise", "parser", "runtime"]
    flips = pg.locator(".stream .tok.flip")
    assert flips.count() == 3
    assert flips.evaluate_all("els => els.map(e => e.dataset.cls)") == ["runtime", "runtime", "runtime"]
    assert "runtime" in flips.first.get_attribute("title")
    assert pg.locator(".turnhead .parser-ok").count() == 1 and pg.locator(".turnhead .parser-mismatch").count() == 0
    # the filter: no tie flips here, so none stays highlighted; runtime brings all three back
    legend.locator("select.classfilter").select_option("tie")
    assert pg.locator(".stream .tok.flip").count() == 0
    assert pg.locator(".stream .tok.filtered").count() == 3
    pg.keyboard.press("n")  # navigation skips filtered flips
    assert pg.locator(".stream .tok.sel").count() == 0
    legend.locator("select.classfilter").select_option("runtime")
    assert pg.locator(".stream .tok.flip").count() == 3
    # free mode: the class in the branch header of each branch that left the reference's
    pg.keyboard.press("f")
    pg.wait_for_selector('.modes .mode[data-mode="free"][aria-selected="true"]')
    heads = pg.locator(".stream .lanehead")
    fa2_head = [h for h in heads.all_inner_texts() if "branch @35" in h and "fa2" in h]
    assert fa2_head and "runtime" in fa2_head[0]
    ref_heads = [h for h in heads.all_inner_texts() if "branch @" in h and "secondary" in h]
    assert ref_heads and all("runtime" not in h for h in ref_heads)  # the reference's branch: no class
    assert pg.locator("#toolcalls .toolcard .fclass.c-runtime").count() == 2
    page.shot("flip-classes")
    assert page.errors == [] and page.dialogs == []
