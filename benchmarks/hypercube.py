"""The hypercube site of 50 rigs: build time, first render in Chromium, bundle size.

    python benchmarks/hypercube.py [--rigs 50] [--from BUNDLE ... [--corpus DIR ...]] [--keep DIR]

How the 50 bundles are synthesized (one suite, one corpus, every bundle accepted by the real
checker):

* **default**: a synthetic corpus (`tensorverse.testing.rig_bundles.make_corpus`: 8 cases x 2
  turns x 17 tokens = 272 positions, about cpu-v1's 274; vocabulary 64) and per rig one
  `synth_bundle` (the real row code and writer) of the same 8 settings (`SCALES`: the
  reference, a noise point, six others at noise scales 0.02-0.9), rig ``i`` with ``rig_seed``
  1000 + i and a jitter of its own (0.01-0.05 nats); on every odd rig the setting
  ``kv_fp8e5m2`` is refused (as vLLM-CPU refuses FP8 KV without AVX-512), so half the rigs ran
  7 settings;
* ``--from BUNDLE...``: real bundles as seeds (checked first, against the shipped corpora and
  ``--corpus``); rig ``i`` copies seed ``i mod len(seeds)`` with a rig label and fingerprint of
  its own and every position's margin jittered (``m * (1 + N(0, s)) + N(0, s / 10)``, ``s``
  0.02-0.10 by rig) and KL scaled by ``exp(N(0, s))``; a position whose margin changes sign
  becomes a flip (top-1 a neighbouring id, top-k the flip's top-1 and the recorded token) or
  stops being one; the summaries are recomputed by the writer; on every odd rig the last
  setting that ran (not the reference or the noise point) is refused instead.

Figures (last line, one JSON object):
  build_s                      check + merge + statistics + site for the 50 bundles
                               (`tensorverse.hypercube.cli.build`, the command's code), with its stages
  site_first_render_ms         Chromium (Debian's, headless) on ``file://.../index.html``: from navigation
                               start to the page's own rendered marker (``window.__hcTiming.rendered_ms``,
                               ``performance.now()`` after the first frame), median of 3 loads
  bundle_bytes                 mean bytes of one bundle file
  bundle_bytes_per_setting_case  per bundle, bytes / (settings it lists x cases of the corpus); the mean
  index_bytes                  the page (data embedded)
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._targets import finish

SCALES = {"bf16": 0, "bf16_noise": 0.05, "dtype_fp32": 0.02, "dtype_fp16": 0.1, "kv_fp8e4m3": 0.6,
          "kv_fp8e5m2": 0.9, "quant_fp8": 0.4, "threads_2": 0.03}
REFUSED_ON_ODD = "kv_fp8e5m2"
CHROMIUM = os.environ.get("TENSORVERSE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def synthetic(out: Path, rigs: int) -> tuple[list[Path], list[str], int, int]:
    from tensorverse.testing.rig_bundles import make_corpus, synth_bundle

    corpus = make_corpus(out / "synthetic-v1", cases=8, turns=2, tokens=17)
    paths = []
    for i in range(rigs):
        refused = {REFUSED_ON_ODD: "refused before start: no AVX-512 or AMX (synthetic)"} if i % 2 else {}
        scales = {k: v for k, v in SCALES.items() if k not in refused}
        paths.append(synth_bundle(out / f"rig-{i:03d}.tvbundle", corpus, rig_label=f"synthetic rig {i:03d}",
                                  scales=scales, refused=refused, rig_seed=1000 + i,
                                  rig_jitter=0.01 + 0.04 * ((7 * i) % 10) / 9, gpu=f"Synthetic GPU {i % 5}"))
    return paths, [str(corpus.path)], len(SCALES), corpus.cases


def _jitter_rows(rows: list[dict], ref: str, rng: np.random.Generator, s: float) -> list[dict]:
    out = []
    for r in rows:
        r = dict(r)
        m = r["margin"] * (1 + rng.normal(0, s)) + rng.normal(0, s / 10)
        was = r["flip"]
        r["margin"] = float(m)
        if r["setting"] != ref:
            r["kl"] = float(r["kl"] * np.exp(rng.normal(0, s)))
        if m < 0 and not was:
            tok = r["token"]
            r["top1"] = tok - 1 if tok > 0 else tok + 1
            r.update(flip=True, flip_class="runtime", topk_ids=[r["top1"], tok],
                     topk_logits=[0.0, min(float(np.float32(m)), 0.0)])
        elif m >= 0 and was:
            r.update(top1=r["token"], flip=False, flip_class=None, topk_ids=None, topk_logits=None)
        out.append(r)
    return out


def from_seeds(out: Path, rigs: int, seeds: list[str], corpus_dirs: list[str]) -> tuple[list[Path], list[str], int, int]:
    from tensorverse.bundle.check import check_bundle
    from tensorverse.bundle.make import SettingOutcome, make_bundle
    from tensorverse.rig.suite import known_corpora

    corpora = known_corpora(corpus_dirs)
    checked = [check_bundle(p, corpora) for p in seeds]
    paths = []
    for i in range(rigs):
        b = checked[i % len(checked)]
        m = b.manifest
        rng = np.random.default_rng([i, 17])
        s = 0.02 + 0.08 * (i % 10) / 9
        ref, noise = m["reference_setting"], m["noise_setting"]
        settings = [dict(x) for x in m["settings"]]
        if i % 2:
            drop = next((x for x in reversed(settings) if x["status"] == "ran" and x["name"] not in (ref, noise)), None)
            if drop is not None:
                drop.update(status="refused", reason="refused (synthetic copy: every odd rig refuses one setting)")
        ran = {x["name"] for x in settings if x["status"] == "ran"}
        positions = _jitter_rows([r for r in b.positions if r["setting"] in ran], ref, rng, s)
        free = [r for r in b.free if r["setting"] in ran]
        outcomes = [SettingOutcome(x["name"], x["axis"], x["value"], x["status"], x["reason"],
                                   tuple(x["vllm_args"]), x["env"]) for x in settings]
        fp = dict(m["rig"]["fingerprint"], synthetic_copy=i)
        paths.append(make_bundle(out / f"rig-{i:03d}.tvbundle", suite=m["suite"], corpus=corpora[m["corpus"]["name"]],
                                 rig_label=f"{m['rig']['label']} (copy {i:03d})", fingerprint=fp, settings=outcomes,
                                 reference=ref, noise=noise, positions=positions, free=free,
                                 provenance={"synthetic_copy_of": os.path.basename(b.path)},
                                 created="2026-12-02T00:00:00Z"))
    return paths, list(corpus_dirs), len(checked[0].manifest["settings"]), int(checked[0].manifest["corpus"]["cases"])


def first_render(index: Path, loads: int = 3) -> tuple[list[float], list[float]]:
    import playwright.sync_api as pw

    rendered, built = [], []
    with pw.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            for _ in range(loads):
                ctx = b.new_context(viewport={"width": 1400, "height": 1000})
                page = ctx.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))  # noqa: B023 - called in this iteration
                page.goto(index.resolve().as_uri())
                page.wait_for_selector("body[data-rendered='1']", timeout=60_000)
                t = page.evaluate("window.__hcTiming")
                if errors:
                    raise RuntimeError(f"page errors: {errors}")
                rendered.append(float(t["rendered_ms"]))
                built.append(float(t["built_ms"]))
                ctx.close()
        finally:
            b.close()
    return rendered, built


def screenshot(index: Path, png: Path) -> None:
    """The docs' picture (docs/hypercube.md): the axes, the heat map, the first position map and
    the multiverse of the first position where a rig's ``quant_fp8`` flips."""
    import playwright.sync_api as pw

    with pw.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = b.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(index.resolve().as_uri())
            page.wait_for_selector("body[data-rendered='1']")
            page.locator("table.pm td.f[data-setting='quant_fp8']").first.click()
            page.wait_for_selector("#multiverse:not([hidden])")
            page.evaluate("window.scrollTo(0, document.getElementById('axes').offsetTop - 60)")
            png.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(png))
        finally:
            b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rigs", type=int, default=50)
    ap.add_argument("--from", dest="seeds", nargs="+", metavar="BUNDLE", help="real bundles as seeds")
    ap.add_argument("--corpus", action="append", default=[], metavar="DIR", help="a corpus the seeds are about")
    ap.add_argument("--keep", metavar="DIR", help="keep the bundles and the site here")
    ap.add_argument("--screenshot", metavar="PNG", type=Path,
                    help="also take the docs' picture of the site (docs/img/hypercube.png: --rigs 6)")
    args = ap.parse_args()
    from tensorverse.hypercube.cli import build

    load0 = os.getloadavg()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-hypercube-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        if args.seeds:
            paths, corpus_dirs, n_settings, n_cases = from_seeds(work, args.rigs, args.seeds, args.corpus)
        else:
            paths, corpus_dirs, n_settings, n_cases = synthetic(work, args.rigs)
        synth_s = time.perf_counter() - t0
        stages: dict[str, float] = {}
        t1 = time.perf_counter()
        index = build([str(p) for p in paths], work / "site", corpus_dirs, progress=False, timings=stages)
        build_s = time.perf_counter() - t1
        rendered, built = first_render(index)
        if args.screenshot:
            screenshot(index, args.screenshot)
        from tensorverse.bundle.io import open_bundle

        sizes = [p.stat().st_size for p in paths]
        mean_bytes = statistics.fmean(sizes)
        per_cell, n_settings = [], 0  # each bundle's bytes / (its settings x the corpus's cases)
        for p, size in zip(paths, sizes):
            m = open_bundle(p).manifest
            n_settings = max(n_settings, len(m["settings"]))
            per_cell.append(size / (len(m["settings"]) * m["corpus"]["cases"]))
        result = {
            "benchmark": "hypercube", "rigs": len(paths), "source": "from" if args.seeds else "synthetic",
            "settings": n_settings, "cases": n_cases,
            "build_s": round(build_s, 3), "build_stages_s": {k: round(v, 3) for k, v in stages.items()},
            "site_first_render_ms": round(statistics.median(rendered), 1),
            "site_built_ms": round(statistics.median(built), 1),
            "site_first_render_runs_ms": [round(x, 1) for x in rendered],
            "bundle_bytes": round(mean_bytes),
            "bundle_bytes_per_setting_case": round(statistics.fmean(per_cell), 1),
            "index_bytes": index.stat().st_size,
            "synthesis_s": round(synth_s, 1),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{result['rigs']} rigs: build {result['build_s']} s ({result['build_stages_s']}), first render "
          f"{result['site_first_render_ms']} ms, bundle {result['bundle_bytes']} B "
          f"({result['bundle_bytes_per_setting_case']} B per setting x case), page {result['index_bytes']} B",
          file=sys.stderr)
    return finish("hypercube", result)


if __name__ == "__main__":
    sys.exit(main())
