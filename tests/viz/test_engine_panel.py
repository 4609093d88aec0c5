"""The top-k panel shows the engine's batch of each member's row (store format 3 engine states):
the view model, and in a real browser (Debian's headless Chromium, as test_browser.py)."""

from __future__ import annotations


import pytest

from tensorverse.store import Store
from tensorverse.store.codec import encode_row
from tensorverse.store.engine_state import RUNNER_V1, EngineState
from tensorverse.store.records import BackendInfo
from tensorverse.testing.records import tsession
from tensorverse.viz.data import ViewData
from tests.viz.viewer_thread import ARGS, CHROMIUM, serve_viewer


def build(path, vz) -> list[int]:
    """A turn with a secondary (batch 1) and a shadow (batch 8, no state at the last position)."""
    HELLO, _run, _turn, _compare = vz.HELLO, vz._run, vz._turn, vz._compare
    base_logits, jitter = vz.base_logits, vz.jitter
    ids = vz.VOCAB.encode(HELLO)
    with Store.open(path) as store:
        store.put_backend("primary", BackendInfo(name="primary", url="http://p", role="primary")).result()
        store.put_backend("secondary", BackendInfo(name="secondary", url="http://s", role="secondary",
                                                   capture="full")).result()
        store.put_backend("batchy", BackendInfo(name="batchy", url="http://b", role="shadow", capture="full")).result()
        store.put_session(tsession("s", created_ns=1)).result()
        _turn(store, "s", "t", 0, HELLO, prompt=[{"role": "user", "content": "hi"}], created_ns=1)
        for rid, backend, batch in (("r-sec", "secondary", 1), ("r-b", "batchy", 8)):
            rows = [jitter(base_logits(ids, p), backend, p) for p in range(len(ids))]
            _run(store, rid, "t", backend, "forced", HELLO, rows=rows,
                 role="secondary" if backend == "secondary" else "shadow")
            # engine states for every row but the last of the shadow
            store.write_rows(rid, [(p, encode_row(r), EngineState(RUNNER_V1, 100 + p, batch, 0, 0)
                                    if backend == "secondary" or p < len(ids) - 1 else None)
                                   for p, r in enumerate(rows)]).result()
        _compare(store, "t")
    return ids


def test_panel_carries_each_members_batch(tmp_path, vz):
    ids = build(tmp_path / "s", vz)
    with Store.open(tmp_path / "s", readonly=True) as ro:
        view = ViewData(ro)
        names = view.turn_view("t", inline_panels=False)["backends"]
        for p in range(len(ids)):
            panel = view.panel("t", "forced", p)["panel"]
            by_name = {names[i]["name"]: e for i, e in zip(panel["m"], panel["e"])}
            assert by_name["secondary"] == {"b": 1, "s": 100 + p}
            assert by_name["batchy"] == ({"b": 8, "s": 100 + p} if p < len(ids) - 1 else None)
        inline = view.turn_view("t", inline_panels=True)["forced"]["panels"]
        assert [pl.get("e") for pl in inline] == [view.panel("t", "forced", p)["panel"].get("e")
                                                  for p in range(len(ids))]


@pytest.mark.browser
def test_topk_panel_shows_each_members_batch(tmp_path, vz):
    import playwright.sync_api as playwright_api

    ids = build(tmp_path / "s", vz)
    errors: list[str] = []
    with serve_viewer(tmp_path / "s") as url, playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = b.new_page(viewport={"width": 1400, "height": 900})
        pg.set_default_timeout(15_000)
        pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(f"{url}#/t/t?mode=forced")
        pg.wait_for_selector("body[data-view=turn]")
        pg.locator('.stream .tok[data-p="2"]').first.click()
        line = pg.locator("#topk p.engine")
        line.wait_for()
        text = line.inner_text()
        assert "secondary" in text and "1 req · step 102" in text
        assert "batchy" in text and "8 req · step 102" in text
        last = len(ids) - 1  # the shadow's last row has no state: only the secondary's shows
        pg.locator(f'.stream .tok[data-p="{last}"]').first.click()
        pg.wait_for_function(f"document.querySelector('#topk h2') && "
                             f"document.querySelector('#topk h2').textContent.startsWith('Position {last}')")
        text = pg.locator("#topk p.engine").inner_text()
        assert f"1 req · step {100 + last}" in text and "8 req" not in text
        b.close()
    assert errors == []
