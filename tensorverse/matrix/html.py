"""A self-contained HTML page of the hypercube: a heat map of flip rate over the first two axes
(other axes pooled), one bar per axis value for the marginals, and the points table. Every value
that came from a spec or a server is escaped; no script, no external resource."""

from __future__ import annotations

import json
from typing import Any, Mapping

from tensorverse.htmlpage import esc
from tensorverse.matrix.spec import render_value

__all__ = ["render_html", "heat_cells"]


def _color(rate: float | None, vmax: float) -> str:
    if rate is None:
        return "#eee"
    x = 0.0 if vmax <= 0 else min(1.0, rate / vmax)
    # white -> red
    g = int(255 - 200 * x)
    return f"rgb(255,{g},{g})"


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def heat_cells(report: Mapping[str, Any]) -> tuple[str | None, str | None, list[list[dict[str, Any]]]]:
    """Rows x columns of pooled flip rates over the first two grid axes (one row when the grid
    has one axis; one cell per point when the spec has named points only)."""
    grid_axes = report.get("grid_axes")
    axes = list(grid_axes if grid_axes is not None else report.get("axes") or {})
    pts = [p for p in report["points"] if p.get("status") == "ok" and p.get("summary")]
    if not axes:
        return None, None, [[{"label": p["name"], "rate": p["summary"].get("flip_rate"),
                              "points": [p["name"]]} for p in pts]]
    a = axes[0]
    b = axes[1] if len(axes) > 1 else None
    rows = []
    for va in report["axes"][a]:
        row = []
        for vb in (report["axes"][b] if b else [None]):
            sel = [p for p in pts if _same((p.get("effective") or {}).get(a), va)
                   and (b is None or _same((p.get("effective") or {}).get(b), vb))]
            pos = sum(p["summary"].get("positions") or 0 for p in sel)
            fl = sum(p["summary"].get("flips") or 0 for p in sel)
            row.append({"a": va, "b": vb, "rate": fl / pos if pos else None, "positions": pos,
                        "points": [p["name"] for p in sel],
                        "reference": any(p.get("reference") for p in sel)})
        rows.append(row)
    return a, b, rows


def render_html(report: Mapping[str, Any]) -> str:
    a, b, cells = heat_cells(report)
    rates = [c["rate"] for r in cells for c in r if c.get("rate") is not None]
    vmax = max(rates) if rates else 0.0
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>Tensorverse matrix</title>",
             "<style>body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}th{background:#f6f6f6}"
             "td.cell{min-width:7em;text-align:center}.bad{color:#a00}</style></head><body>",
             f"<h1>Matrix: {esc(report.get('served_name'))}</h1>",
             f"<p>{esc(len(report['points']))} points over {esc(report['corpus']['cases'])} case(s) of "
             f"{esc(report['corpus']['name'])}; forced runs compared with the reference point "
             f"<b>{esc(report['reference'])}</b>.</p>",
             "<h2>Flip rate heat map</h2><table id='heatmap'>"]
    if a is None:
        parts.append("<tr>" + "".join(f"<th>{esc(c['label'])}</th>" for c in cells[0]) + "</tr><tr>")
        parts += [f"<td class='cell' style='background:{_color(c['rate'], vmax)}'>{esc(_pct(c['rate']))}</td>"
                  for c in cells[0]]
        parts.append("</tr>")
    else:
        head = [f"<th>{esc(a)} \\ {esc(b)}</th>" if b else f"<th>{esc(a)}</th><th>flip rate</th>"]
        if b:
            head += [f"<th>{esc(render_value(v))}</th>" for v in report["axes"][b]]
        parts.append("<tr>" + "".join(head) + "</tr>")
        for row in cells:
            parts.append(f"<tr><th>{esc(render_value(row[0]['a']))}</th>")
            for c in row:
                title = ", ".join(c["points"])
                label = "ref" if c["reference"] and not c["positions"] else _pct(c["rate"])
                parts.append(f"<td class='cell' title='{esc(title)}' style='background:{_color(c['rate'], vmax)}'>"
                             f"{esc(label)}</td>")
            parts.append("</tr>")
    parts.append("</table>")
    parts.append("<h2>Marginal effects</h2>")
    for axis, vals in (report.get("marginals") or {}).items():
        parts.append(f"<table><tr><th>{esc(axis)}</th><th>points</th><th>positions</th><th>flip rate</th>"
                     "<th>95% CI</th><th>KL mean</th><th>effect</th><th>effect 95% CI</th></tr>")
        for v in vals:
            ci = v.get("flip_rate_ci") or [None, None]
            eci = v.get("effect_ci") or [None, None]
            parts.append(f"<tr><th>{esc(render_value(v['value']))}</th><td>{esc(len(v['points']))}</td>"
                         f"<td>{esc(v['positions'])}</td><td>{esc(_pct(v.get('flip_rate')))}</td>"
                         f"<td>{esc(_pct(ci[0]))} – {esc(_pct(ci[1]))}</td><td>{esc(_sci(v.get('kl_mean')))}</td>"
                         f"<td>{esc(_pct(v.get('effect'), sign=True))}</td>"
                         f"<td>{esc(_pct(eci[0], sign=True))} – {esc(_pct(eci[1], sign=True))}</td></tr>")
        parts.append("</table>")
    parts.append("<h2>Points</h2><table><tr><th>point</th><th>status</th><th>positions</th><th>flips</th>"
                 "<th>flip rate</th><th>KL mean</th><th>free diverged vs ref</th><th>start s</th>"
                 "<th>replay s</th></tr>")
    for p in report["points"]:
        s = p.get("summary") or {}
        fv = p.get("free_vs_reference") or {}
        t = p.get("timings") or {}
        cls = "" if p["status"] == "ok" else " class='bad'"
        parts.append(f"<tr><th>{esc(p['name'])}{' (ref)' if p.get('reference') else ''}</th>"
                     f"<td{cls} title='{esc(p.get('error') or '')}'>{esc(p['status'])}</td>"
                     f"<td>{esc(s.get('positions'))}</td><td>{esc(s.get('flips'))}</td>"
                     f"<td>{esc(_pct(s.get('flip_rate')))}</td><td>{esc(_sci((s.get('kl') or {}).get('mean')))}</td>"
                     f"<td>{esc(str(fv.get('diverged')) + '/' + str(fv.get('turns')) if fv.get('turns') else None)}</td>"
                     f"<td>{esc(_num(t.get('start_s')))}</td><td>{esc(_num(t.get('replay_s')))}</td></tr>")
    parts.append("</table></body></html>\n")
    return "".join(parts)


def _pct(v: float | None, sign: bool = False) -> str | None:
    return None if v is None else (f"{v * 100:+.2f}%" if sign else f"{v * 100:.2f}%")


def _sci(v: float | None) -> str | None:
    return None if v is None else f"{v:.2e}"


def _num(v: float | None) -> str | None:
    return None if v is None else f"{v:.0f}"
