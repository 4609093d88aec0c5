"""The hypercube's static site: one page that opens from disk (``file://``), no server, no network.

Layout of ``DIR``::

    DIR/index.html             the page: the merged data embedded as JSON, nothing else inline
    DIR/static/hypercube.js    the app (copied from the package), renders everything
    DIR/static/hypercube.css

The data is one JSON object (:func:`site_data`) in ``<script type="application/json"
id="hc-data">``, made safe to embed by escaping ``<``, ``>``, ``&``, U+2028 and U+2029 as
``\\u003c`` ... (as the viewer's export does, :mod:`tensorverse.viz.export`): no bundle string can
close the element or open a comment, and ``JSON.parse`` reads the escapes back. The page's
Content-Security-Policy (a ``<meta>``) is ``default-src 'none'`` with only ``script-src 'self'``
and ``style-src 'self'``: the two files next to the page run, no inline script or style, no
connection, no image, no frame, no form. (A hash source cannot name an external script here:
Chromium checks it through Subresource Integrity, which a ``file://`` response is not eligible
for; on a ``file://`` page ``'self'`` is the ``file:`` scheme.) The app builds every element
with ``createElement`` and sets every bundle string with ``textContent`` and every attribute
with ``setAttribute``: rig labels, fingerprints, GPU names, setting names, reasons and case ids
are untrusted and show as text.

Floats in the lanes (margin, KL per position) are rounded to 4 significant digits: what the
page shows; the bundles keep the exact values.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Sequence


from tensorverse.htmlpage import embed_json, esc
from tensorverse.hypercube.merge import Hypercube
from tensorverse.hypercube.stats import CONFIDENCE, METHOD, REPLICATES, SEED, Marginal

__all__ = ["SITE_FORMAT", "STATIC_DIR", "CSP", "site_data", "render_index", "write_site", "embed_json"]

SITE_FORMAT = "tensorverse.hypercube-site"
STATIC_DIR = Path(__file__).resolve().parent / "static"
ASSETS = ("hypercube.js", "hypercube.css")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'none'; connect-src 'none'; "
       "base-uri 'none'; form-action 'none'")

def _r4(x: float) -> float:
    return float(f"{x:.4g}")


def site_data(cube: Hypercube, marginals: Sequence[Marginal], *, generator: str | None = None) -> dict[str, Any]:
    """The page's data: the merged model in the shape the app reads (indices into ``rigs`` and
    ``settings``; per case and turn the recorded tokens and every lane)."""
    sidx = {s.name: i for i, s in enumerate(cube.settings)}
    cells: list[list[dict[str, Any] | None]] = [[None] * len(cube.settings) for _ in cube.rigs]
    for c in cube.cells:
        d: dict[str, Any] = {"status": c.status, "reason": c.reason, "vllm_args": list(c.vllm_args)}
        if c.summary is not None:
            s = c.summary
            d.update(positions=s.positions, flips=s.flips, flip_rate=s.flip_rate, turns=s.turns,
                     turns_with_flip=s.turns_with_flip, kl_mean=s.kl_mean, kl_max=s.kl_max,
                     flips_by_class=dict(s.flips_by_class), free_turns=s.free_turns, free_diverged=s.free_diverged,
                     tool_call_breaks=s.tool_call_breaks, free_errors=s.free_errors)
        cells[c.rig][sidx[c.setting]] = d
    lanes: dict[tuple[str, int], list[list[Any]]] = {}
    for ln in cube.lanes:
        flips = [[f.position, f.top1, f.flip_class, list(f.topk_ids), [_r4(x) for x in f.topk_logits]]
                 for f in ln.flips]
        lanes.setdefault((ln.case, ln.turn), []).append(
            [ln.rig, sidx[ln.setting], [_r4(x) for x in ln.margin], [_r4(x) for x in ln.kl], flips])
    cases: dict[str, list[dict[str, Any]]] = {}
    for t in cube.turns:
        cases.setdefault(t.case, []).append({"turn": t.turn, "tokens": list(t.tokens),
                                             "lanes": lanes.get((t.case, t.turn), [])})
    return {
        "format": SITE_FORMAT, "version": 1, "generator": generator,
        "suite": dict(cube.suite), "corpus": dict(cube.corpus), "reference": cube.reference, "noise": cube.noise,
        "method": {"text": METHOD, "replicates": REPLICATES, "seed": SEED, "confidence": CONFIDENCE},
        "settings": [{"name": s.name, "axis": s.axis, "value": s.value} for s in cube.settings],
        "axes": [{"axis": a, "settings": [sidx[s.name] for s in ss]} for a, ss in cube.axes.items()],
        "rigs": [{"id": r.id, "label": r.label, "hardware": r.hardware, "fingerprint": r.fingerprint,
                  "bundle": os.path.basename(r.bundle), "created": r.created,
                  "tensorverse_version": r.tensorverse_version} for r in cube.rigs],
        "cells": cells,
        "marginals": [m.as_dict() for m in marginals],
        "cases": [{"id": c, "turns": ts} for c, ts in cases.items()],
    }


def render_index(data: dict[str, Any]) -> str:
    """``index.html``: the CSP, the data, the two assets; the app renders the rest."""
    title = f"Tensorverse hypercube · {data['suite']['name']} · {len(data['rigs'])} rigs"
    return (
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{esc(CSP)}\">\n"
        "<meta name=\"referrer\" content=\"no-referrer\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{esc(title)}</title>\n"
        "<link rel=\"stylesheet\" href=\"static/hypercube.css\">\n</head>\n<body>\n"
        "<header class=\"top\"><span class=\"brand\">Tensorverse hypercube</span>"
        "<span id=\"hc-title\"></span><span class=\"spacer\"></span>"
        "<span id=\"status\" class=\"muted\" role=\"status\"></span></header>\n"
        "<main id=\"app\"><p class=\"muted\" id=\"loading\">Loading… (this page needs JavaScript)</p></main>\n"
        f"<script type=\"application/json\" id=\"hc-data\">{embed_json(data)}</script>\n"
        "<script src=\"static/hypercube.js\"></script>\n</body>\n</html>\n"
    )


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_site(data: dict[str, Any], out: str | os.PathLike) -> Path:
    """Write the site into the directory ``out`` (created; other files there are left alone);
    returns the index path. The assets are written before the page that loads them."""
    d = Path(out)
    (d / "static").mkdir(parents=True, exist_ok=True)
    for name in ASSETS:
        tmp = d / "static" / (name + ".tmp")
        shutil.copyfile(STATIC_DIR / name, tmp)
        os.replace(tmp, d / "static" / name)
    index = d / "index.html"
    _write(index, render_index(data).encode("utf-8"))
    return index
