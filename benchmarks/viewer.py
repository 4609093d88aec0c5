"""The multiverse viewer on a long turn: time to first render and to interactive in headless
Chromium, and the JSON API's payload, for a turn of 2,000 tokens x 5 backends (target: < 1 s).

    python benchmarks/viewer.py [--tokens 2000] [--vocab 151936] [--repeats 5] [--free-repeats 3]
                                [--quick] [--skip-no-comparisons]

The turn (``benchmarks/_viewer_store.py``) is written with the real Store API into a throwaway
store (on /dev/shm when there is room): primary (recorded top-5 logprobs), secondary, fa2, fp8 and
sdpa, with logits rows (synthetic, ``--vocab`` wide), forced flips in every region, and free runs
that branch three times (thinking, content, inside a tool-call argument: four distinct outputs,
tool-call verdicts match / value_mismatch / wrong_func_name). ``tensorverse.shadow.compare.
compare_turn`` then stores the comparisons, as the shadow runner does. The viewer is the real
``tensorverse view`` command (its own process, 127.0.0.1, a free port); the browser is Debian's
Chromium (``/usr/bin/chromium`` or $TENSORVERSE_CHROMIUM) driven by Playwright, launched as the
browser tests launch it.

Definitions (every browser time is ``performance.now()`` in the page: milliseconds since the
navigation started, i.e. since the page's time origin; an init script records the marks):

``first_render_ms``  navigation start -> ``window.__tvTiming`` set: the app has fetched
                     ``/api/turns/{id}`` and drawn the turn (every token span, flip markers, KL
                     sparklines, tool-call cards) into the DOM. ``first_paint_ms``: the first
                     frame after that has been painted (requestAnimationFrame + a task).
``interactive_ms``   navigation start -> the first token click shows its top-k panel: as soon as
                     that first frame is painted, the first flip token is clicked (a click event
                     dispatched in the page), the app fetches the position's panel
                     (``/api/turns/{id}/panel``: the turn has lazy panels) and draws it; the time
                     is when the frame showing the panel's table has been painted.
                     ``click_to_panel_ms``: that click -> panel painted.
``hover_panel_ms``   a real pointer hover (Playwright's mouse, a trusted event) on another flip
                     token -> its panel painted (includes the app's 80 ms hover debounce).
``payload_bytes``    the body of ``GET /api/turns/{id}``, uncompressed (what the app parses);
                     ``payload_wire_bytes``: the same response as sent with the browser's
                     Accept-Encoding (``payload_encoding``); ``browser_transfer_bytes``: what
                     Chromium's resource timing saw. ``panel_bytes``: one lazily fetched panel.

Forced mode (the default view) is measured ``--repeats`` times, each in a fresh tab of one
browser context (a reload: static assets revalidated from cache; the server has the view cached),
after one cold load (fresh server, empty cache: ``cold_*``, which includes the server building the
view). ``free_*``: the same for the free mode (the multiverse tree), ``--free-repeats`` times.
Reported values are medians; every sample is in ``samples``.

Server side, in this process: ``view_build_ms`` (``ViewData.turn_view`` with the stored
comparisons, fresh ViewData each time, median of 3), ``view_build_ms_no_comparisons`` (the same
before ``compare_turn`` ran: the metrics are recomputed from every forced row), ``compare_turn_ms``,
``view_cached_ms`` (``turn_view`` again on the same ViewData: the view is cached, but the turn's
records are read and parsed to check it is current), ``panel_build_ms`` (one forced panel: the
same check, then every backend's row at the position decoded). Over HTTP:
``api_turn_cold_ms`` (the cold load's fetch, from the page's __tvTiming), ``api_turn_ms`` (warm),
``api_panel_ms``. The browser figures and the payload do not depend on ``--vocab``; the row
decoding in ``compare_turn_ms``, ``view_build_ms_no_comparisons`` and the panels scales with it
(the default is Qwen3's 151,936, the vocabulary of the models Tensorverse runs behind; until
2026-12-02 it was 32,768, 4.6x narrower, and the store takes far longer to write at the real width).

About 270 s in all at load 7 with the default width (70 s at 32,768 wide; ``--quick``: about 30 s less). This machine's 2 cores are shared with other work: figures move with the load average, reported
as ``loadavg_start``/``loadavg_end`` (1, 5, 15 min). Everything started here (the viewer process,
Chromium, Playwright's driver, the store) is stopped and removed on exit. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._targets import finish  # noqa: E402
from benchmarks._viewer_store import build_long_turn  # noqa: E402
from tensorverse.ports import free_port  # noqa: E402

CHROMIUM = os.environ.get("TENSORVERSE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ACCEPT_ENCODING = "gzip, deflate, br, zstd"  # what Chromium sends
TARGET_MS = 1000.0
FLIP_SELECTOR = ".stream .tok.flip:not(.refbranch)"

# Runs before the app's script in every page (CDP-injected: the viewer's CSP does not apply).
INIT_JS = r"""
(() => {
  const B = window.__tvBench = {};
  const after = (fn) => requestAnimationFrame(() => setTimeout(fn, 0));  // after the next paint
  function watchPanel(pos, out, done) {
    const box = document.getElementById("topk");
    if (!box) return;
    const ok = () => {
      const h = box.querySelector("h2");
      return box.querySelector("table.topktable") && h && (pos === null || h.textContent.startsWith("Position " + pos + " "));
    };
    const fire = () => { out.panel_at = performance.now(); after(() => { out.painted_at = performance.now(); if (done) done(); }); };
    const mo = new MutationObserver(() => { if (ok()) { mo.disconnect(); fire(); } });
    mo.observe(box, { childList: true, subtree: true, characterData: true });
  }
  B.watchPanel = watchPanel;
  let timing;
  Object.defineProperty(window, "__tvTiming", {
    configurable: true,
    get() { return timing; },
    set(v) {
      timing = v;
      if (B.render_at !== undefined) return;
      B.render_at = performance.now();
      B.timing = v;
      after(() => {
        B.painted_at = performance.now();
        const tok = document.querySelector(%(selector)s);
        if (!tok) { B.error = "no flip token to click"; return; }
        B.click = { pos: tok.dataset.p };
        watchPanel(tok.dataset.p, B.click, null);
        B.click.at = performance.now();
        tok.dispatchEvent(new MouseEvent("click", { bubbles: true, cancelable: true, view: window }));
      });
    },
  });
})();
"""

ARM_HOVER_JS = r"""
(sel) => {
  const B = window.__tvBench;
  const toks = document.querySelectorAll(sel);
  const tok = toks[Math.min(2, toks.length - 1)];
  B.hover = { pos: tok.dataset.p };
  tok.addEventListener("mouseover", (ev) => { if (B.hover.event_at === undefined) B.hover.event_at = ev.timeStamp; });
  B.watchPanel(tok.dataset.p, B.hover, null);
  return Array.prototype.indexOf.call(toks, tok);
}
"""

COLLECT_JS = r"""
() => {
  const nav = performance.getEntriesByType("navigation")[0] || {};
  const api = performance.getEntriesByType("resource").filter((r) => /\/api\/turns\/[^/]+$/.test(r.name))[0] || {};
  return {
    bench: window.__tvBench, nav: { response_end: nav.responseEnd, dcl: nav.domContentLoadedEventEnd, load: nav.loadEventEnd },
    api: { transfer: api.transferSize, encoded: api.encodedBodySize, decoded: api.decodedBodySize, start: api.startTime, end: api.responseEnd },
    spans: document.querySelectorAll(".stream .tok").length, flips: document.querySelectorAll(".stream .tok.flip").length,
  };
}
"""


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 1) if xs else None


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _die_with_parent() -> None:
    """In the viewer's process: SIGTERM it if this benchmark dies (Linux prctl PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _get(url: str, encoding: str | None = None) -> tuple[bytes, dict, float]:
    req = urllib.request.Request(url, headers={"Accept": "application/json",
                                               **({"Accept-Encoding": encoding} if encoding else {})})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        body = r.read()
        headers = dict(r.headers)
    return body, headers, _ms(t0)


class Viewer:
    """``tensorverse view`` in its own process, stopped on exit."""

    def __init__(self, store: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorverse.cli", "view", "--store", str(store),
             "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the viewer exited ({self.proc.returncode}): {log.read_text()[-2000:]}")
            try:
                _get(self.url + "api/health")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the viewer did not answer within 30 s") from None
                time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def _wait_bench(page: Any, keys: list[str], timeout_s: float = 30.0) -> dict:
    """Poll ``window.__tvBench`` until the dotted ``keys`` are all set."""
    deadline = time.monotonic() + timeout_s
    while True:
        b = page.evaluate("() => window.__tvBench")
        if b and b.get("error"):
            raise RuntimeError(b["error"])

        def has(k: str) -> bool:
            cur: Any = b  # noqa: B023 - called in this iteration
            for part in k.split("."):
                if not isinstance(cur, dict) or cur.get(part) is None:
                    return False
                cur = cur[part]
            return True

        if b and all(has(k) for k in keys):
            return b
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {keys}: {b}")
        time.sleep(0.02)


def _load_turn(context: Any, url: str, *, hover: bool) -> dict:
    """One page load of the turn: the marks of INIT_JS, plus a real hover when asked."""
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        page.set_default_timeout(30_000)
        page.goto(url)
        _wait_bench(page, ["painted_at", "click.painted_at"])
        out: dict[str, Any] = {}
        if hover:
            idx = page.evaluate(ARM_HOVER_JS, FLIP_SELECTOR)
            page.locator(FLIP_SELECTOR).nth(idx).hover()
            _wait_bench(page, ["hover.event_at", "hover.painted_at"])
        c = page.evaluate(COLLECT_JS)
        if errors:
            raise RuntimeError(f"page errors: {errors[:3]}")
        b = c["bench"]
        out.update({
            "first_render_ms": b["render_at"],
            "first_paint_ms": b["painted_at"],
            "interactive_ms": b["click"]["painted_at"],
            "click_to_panel_ms": b["click"]["painted_at"] - b["click"]["at"],
            "fetch_ms": b["timing"]["fetch_ms"],
            "render_ms": b["timing"]["render_ms"],
            "html_ms": c["nav"]["response_end"],
            "dcl_ms": c["nav"]["dcl"],
            "api_fetch_start_ms": c["api"]["start"],
            "browser_transfer_bytes": c["api"]["transfer"],
            "browser_encoded_bytes": c["api"]["encoded"],
            "browser_decoded_bytes": c["api"]["decoded"],
            "spans": c["spans"],
            "flip_markers": c["flips"],
        })
        if hover:
            out["hover_panel_ms"] = b["hover"]["painted_at"] - b["hover"]["event_at"]
        return out
    finally:
        page.close()


def _server_side(path: Path, tid: str, flips: list[int], *, no_cmp: bool) -> dict:
    """ViewData timings in this process (before and after compare_turn)."""
    from tensorverse.shadow.compare import compare_turn
    from tensorverse.store import Store
    from tensorverse.viz.data import ViewData

    out: dict[str, Any] = {}
    if no_cmp:
        with Store.open(path, readonly=True) as st:
            t0 = time.perf_counter()
            ViewData(st).turn_view(tid)
            out["view_build_ms_no_comparisons"] = round(_ms(t0), 1)
    with Store.open(path, durable=False) as st:
        t0 = time.perf_counter()
        res = compare_turn(st, tid)
        out["compare_turn_ms"] = round(_ms(t0), 1)
        out["comparisons"] = len(res)
    builds, panels = [], []
    with Store.open(path, readonly=True) as st:
        for _ in range(3):
            vd = ViewData(st)
            t0 = time.perf_counter()
            view = vd.turn_view(tid)
            builds.append(_ms(t0))
        cached = []
        for _ in range(3):  # the view cached: what every request pays to check it is current
            t0 = time.perf_counter()
            vd.turn_view(tid)
            cached.append(_ms(t0))
        for p in flips[:3]:
            t0 = time.perf_counter()
            vd.panel(tid, "forced", p)
            panels.append(_ms(t0))
    out["view_build_ms"] = _median(builds)
    out["view_build_ms_samples"] = [round(x, 1) for x in builds]
    out["view_cached_ms"] = _median(cached)
    out["panel_build_ms"] = _median(panels)
    out["lazy_panels"] = view["lazy_panels"]
    out["forced_flip_positions"] = len(view["forced"]["flips"])
    out["branch_points"] = len(view["free"]["branch_points"])
    out["tree_nodes"] = len(view["free"]["nodes"])
    out["verdicts"] = sorted({e["verdict"]["verdict"] for e in view["free"]["toolcalls"] if e["verdict"]})
    out["first_flip"] = view["forced"]["flips"][0]["position"] if view["forced"]["flips"] else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--vocab", type=int, default=151_936,
                    help="logits row width (default 151936, Qwen3's; smaller is faster to build)")
    ap.add_argument("--repeats", type=int, default=5, help="forced-mode loads after the cold one")
    ap.add_argument("--free-repeats", type=int, default=3, help="free-mode loads")
    ap.add_argument("--quick", action="store_true", help="3 + 1 loads, no build without comparisons")
    ap.add_argument("--skip-no-comparisons", action="store_true",
                    help="skip timing the view build before compare_turn (~76 s at 151,936 wide, ~10 s at 32,768)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.free_repeats, args.skip_no_comparisons = 3, 1, True
    if not Path(CHROMIUM).exists():
        print(f"no Chromium at {CHROMIUM} (apt-get install chromium; never `playwright install`)",
              file=sys.stderr)
        return 2
    import playwright.sync_api as pw

    t_start = time.perf_counter()
    load_start = _load()
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() and shutil.disk_usage(shm).free > 3 * 2**30 else None
    tmp = Path(tempfile.mkdtemp(prefix="tv-bench-viewer-", dir=base))
    viewer: Viewer | None = None
    result: dict[str, Any] = {"benchmark": "viewer"}
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        store_path = tmp / "store"
        info = build_long_turn(store_path, tokens=args.tokens, vocab=args.vocab)
        print(f"store: {info.tokens} tokens x {len(info.backends)} backends, {info.rows_written} rows "
              f"({info.vocab} wide) in {info.build_s:.1f} s", flush=True)
        flips_all = sorted({p for v in info.forced_flips.values() for p in v})
        server = _server_side(store_path, info.turn_id, flips_all, no_cmp=not args.skip_no_comparisons)
        no_cmp = server.get("view_build_ms_no_comparisons")
        print(f"server side: view build {server['view_build_ms']} ms with comparisons, "
              f"{'(skipped)' if no_cmp is None else f'{no_cmp} ms'} without; "
              f"compare_turn {server['compare_turn_ms']} ms; a panel {server['panel_build_ms']} ms", flush=True)

        viewer = Viewer(store_path, tmp / "viewer.log")
        turn_url = f"{viewer.url}#/t/{info.turn_id}"
        with pw.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                context = browser.new_context(viewport={"width": 1500, "height": 1000})
                context.add_init_script(INIT_JS % {"selector": json.dumps(FLIP_SELECTOR)})
                cold = _load_turn(context, turn_url, hover=False)  # fresh server, empty cache
                # the payload, as the app gets it and as it goes over the wire
                api = f"{viewer.url}api/turns/{info.turn_id}"
                body, _, warm_ms = _get(api)
                wire, headers, _ = _get(api, ACCEPT_ENCODING)
                pbody, _, panel_ms = _get(f"{api}/panel?mode=forced&p={server['first_flip']}")
                runs = [_load_turn(context, turn_url, hover=True) for _ in range(args.repeats)]
                free = [_load_turn(context, turn_url + "?mode=free", hover=False)
                        for _ in range(args.free_repeats)]
                version = browser.version
                context.close()
            finally:
                browser.close()
        viewer.close()
        viewer = None

        def med(rows: list[dict], key: str) -> float | None:
            return _median([r.get(key) for r in rows])

        result.update({
            "tokens": info.tokens,
            "backends": len(info.backends),
            "backend_names": list(info.backends),
            "first_render_ms": med(runs, "first_render_ms"),
            "interactive_ms": med(runs, "interactive_ms"),
            "payload_bytes": len(body),
            "payload_wire_bytes": len(wire),
            "payload_encoding": headers.get("Content-Encoding", "identity"),
            "target_ms": TARGET_MS,  # the gate: benchmarks/targets.toml
            "first_paint_ms": med(runs, "first_paint_ms"),
            "fetch_ms": med(runs, "fetch_ms"),
            "render_ms": med(runs, "render_ms"),
            "click_to_panel_ms": med(runs, "click_to_panel_ms"),
            "hover_panel_ms": med(runs, "hover_panel_ms"),
            "html_ms": med(runs, "html_ms"),
            "browser_transfer_bytes": runs[-1]["browser_transfer_bytes"] if runs else None,
            "spans": runs[-1]["spans"] if runs else None,
            "flip_markers": runs[-1]["flip_markers"] if runs else None,
            "cold_first_render_ms": round(cold["first_render_ms"], 1),
            "cold_interactive_ms": round(cold["interactive_ms"], 1),
            "api_turn_cold_ms": round(cold["fetch_ms"], 1),
            "api_turn_ms": round(warm_ms, 1),
            "api_panel_ms": round(panel_ms, 1),
            "panel_bytes": len(pbody),
            "free_first_render_ms": med(free, "first_render_ms"),
            "free_interactive_ms": med(free, "interactive_ms"),
            "free_spans": free[-1]["spans"] if free else None,
            **{k: v for k, v in server.items() if k != "first_flip"},
            "vocab": info.vocab,
            "rows": info.rows_written,
            "store_build_s": round(info.build_s, 1),
            "repeats": args.repeats,
            "free_repeats": args.free_repeats,
            "samples": {
                "first_render_ms": [round(r["first_render_ms"], 1) for r in runs],
                "interactive_ms": [round(r["interactive_ms"], 1) for r in runs],
                "hover_panel_ms": [round(r["hover_panel_ms"], 1) for r in runs],
                "free_first_render_ms": [round(r["first_render_ms"], 1) for r in free],
                "free_interactive_ms": [round(r["interactive_ms"], 1) for r in free],
            },
            "chromium": version,
            "source": "synthetic",
            "cpus": os.cpu_count(),
        })
    finally:
        if viewer is not None:
            viewer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    result["loadavg_start"] = load_start
    result["loadavg_end"] = _load()
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    print(f"forced: first render {result['first_render_ms']} ms, interactive {result['interactive_ms']} ms "
          f"(cold {result['cold_first_render_ms']} / {result['cold_interactive_ms']} ms); free: "
          f"{result['free_first_render_ms']} / {result['free_interactive_ms']} ms; payload "
          f"{result['payload_bytes']} B ({result['payload_wire_bytes']} B {result['payload_encoding']}); "
          f"load {result['loadavg_start'][0]} -> {result['loadavg_end'][0]}", flush=True)
    return finish("viewer", result)


if __name__ == "__main__":
    sys.exit(main())
