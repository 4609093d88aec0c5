"""The replay's HTML report: an index page (the summary table, the ``--fail-on`` verdicts, one row
per case) and, for every diverging case, the viewer's self-contained multiverse page of that
case (:func:`tensorverse.viz.export.render_html` on :meth:`ViewData.export_bundle`).

Written by ``tensorverse replay ... --html DIR`` at the end of a run (from the run's working
store), or later by ``tensorverse report html RESULTS --store DIR --out DIR`` from a results file
and the store the replay kept (``--store``). Layout::

    DIR/index.html            the summary and the case list (no script; strict CSP)
    DIR/cases/<case id>.html  the multiverse view of one diverging case (viewer export)

A case *diverges* when a non-reference backend has a forced flip or a departure, a free run that
diverged from the basis or whose tool calls do not match, a branch that left the recorded path,
or an error. The pages hold the scrubbed prompts and outputs (the viewer shows text); the index
holds no text but case ids, backend names and numbers. All data is escaped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from tensorverse.htmlpage import csp_hash, esc
from tensorverse.replay.report import RESULTS_FORMAT

__all__ = ["diverging", "write_html_report", "case_page_name"]

_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1d2330}
table{border-collapse:collapse;margin:8px 0 20px}th,td{padding:3px 9px;border-bottom:1px solid #dde;
text-align:right;white-space:nowrap}th:first-child,td:first-child{text-align:left}
.fail{color:#b3261e;font-weight:600}.ok{color:#1b7f3b}.muted{color:#667}code{font-size:13px}"""


def case_page_name(case_id: str) -> str:
    """The case page's file name under ``cases/`` (case ids are hashes; anything else is made safe)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(case_id))[:120]
    return f"{safe}.html"


def diverging(case: Mapping[str, Any], reference: str | None) -> dict[str, list[str]]:
    """Why a case result diverges: ``{backend: [reasons]}`` (empty: it does not)."""
    out: dict[str, list[str]] = {}
    if case.get("error"):
        out.setdefault("*", []).append(f"error: {case['error']}")
    for t in case.get("turns") or ():
        for name, r in (t.get("backends") or {}).items():
            if name == reference:
                continue
            why: list[str] = []
            f = r.get("forced") or {}
            if f.get("status") not in (None, "ok"):
                why.append(f"forced {f['status']}")
            if f.get("flips"):
                why.append(f"turn {t['index']}: {len(f['flips'])} forced flip(s)")
            elif f.get("departures"):
                why.append(f"turn {t['index']}: {len(f['departures'])} departure(s)")
            fr = r.get("free") or {}
            if fr.get("status") not in (None, "ok"):
                why.append(f"free {fr['status']}")
            elif fr.get("diverged") or fr.get("verdict") not in (None, "match"):
                why.append(f"turn {t['index']}: free {fr.get('verdict') or 'diverged'}"
                           f" at {fr.get('first_flip')}")
            if why:
                out.setdefault(name, []).extend(why)
    for name, b in (case.get("branches") or {}).items():
        if name != reference and b.get("status") not in ("completed", "refused"):
            out.setdefault(name, []).append(f"branch {b['status']} at turn {b.get('turn')}")
    return out


def _index(results: Mapping[str, Any], rows: list[tuple[Mapping[str, Any], dict, bool]]) -> str:
    from tensorverse.replay.report import _summary_rows

    ref = results.get("reference")
    table = _summary_rows(results.get("summary") or {})
    head = "".join(f"<th>{esc(c)}</th>" for c in table[0])
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in table[1:])
    corpus = results.get("corpus") or {}
    failed = (results.get("thresholds") or {}).get("failed") or []
    rules = (results.get("thresholds") or {}).get("rules") or []
    gate = ""
    if rules:
        gate = "<h2>--fail-on</h2><ul>" + "".join(
            f"<li class=\"fail\">FAIL {esc(f.get('message'))}</li>" for f in failed) + (
            "" if failed else "<li class=\"ok\">every rule holds: " + esc(", ".join(rules)) + "</li>") + "</ul>"
    items = []
    for case, why, page in rows:
        link = (f"<a href=\"cases/{esc(case_page_name(case['id']))}\">{esc(case['id'])}</a>" if page
                else esc(case["id"]))
        reasons = "; ".join(f"{n}: {', '.join(w)}" for n, w in why.items()) or "no divergence"
        branches = " ".join(f"{n}={b.get('status')}" for n, b in (case.get("branches") or {}).items())
        basis = [t.get("basis") or {} for t in case.get("turns") or ()]
        changed = sum(1 for b in basis if (b.get("vs_recorded") or {}).get("diverged"))
        items.append(f"<tr data-case=\"{esc(case['id'])}\" data-diverging=\"{'1' if why else '0'}\">"
                     f"<td>{link}</td><td>{len(case.get('turns') or ())}</td>"
                     f"<td class=\"{'fail' if why else 'ok'}\">{esc(reasons)}</td>"
                     f"<td>{esc(branches)}</td><td>{changed}/{len(basis)}</td></tr>")
    n_div = sum(1 for _, why, _ in rows if why)
    title = f"Tensorverse replay · {corpus.get('name')}"
    return (
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src {csp_hash(_CSS)}; "
        "base-uri 'none'; form-action 'none'\">\n<meta name=\"referrer\" content=\"no-referrer\">\n"
        f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{esc(title)}</h1>\n"
        f"<p class=\"muted\">{esc(corpus.get('cases'))} case(s) on {len(results.get('summary') or {})} "
        f"backend(s), reference <code>{esc(ref)}</code>; forced metrics against the reference's forced "
        f"run, free runs against the basis (the reference's own output on the scrubbed prompt); "
        f"{esc(results.get('created'))}; {esc(results.get('wall_s'))} s.</p>\n"
        f"<table id=\"summary\"><tr>{head}</tr>{body}</table>\n{gate}\n"
        f"<h2>Cases ({n_div} diverging)</h2>\n<table id=\"cases\"><tr><th>case</th><th>turns</th>"
        "<th>divergence</th><th>branches</th><th>basis != recorded</th></tr>"
        + "".join(items) + "</table>\n"
        "<p class=\"muted\">Each diverging case links to its multiverse view (the viewer's export: "
        "the basis as the trunk, every backend's forced and free runs).</p>\n</body>\n</html>\n"
    )


def write_html_report(results: Mapping[str, Any], store: Any, out: str | os.PathLike) -> Path:
    """Write the report into the directory ``out``; ``store`` is the replay's store (a path or an
    open :class:`~tensorverse.store.Store`). Returns the index path. A case whose session is not
    in the store is listed without a page."""
    from tensorverse.store import Store
    from tensorverse.viz.data import NotFound, ViewData
    from tensorverse.viz.export import render_html

    d = Path(out)
    (d / "cases").mkdir(parents=True, exist_ok=True)
    own = not hasattr(store, "get_session")
    st = Store.open(store, readonly=True) if own else store
    try:
        view = ViewData(st)
        rows = []
        for case in results.get("cases") or ():
            why = diverging(case, results.get("reference"))
            page = False
            if why and case.get("session"):
                try:
                    bundle = view.export_bundle(case["session"])
                except (NotFound, KeyError):
                    bundle = None
                if bundle is not None:
                    text = render_html(bundle, title=f"Tensorverse replay · case {case['id']}")
                    _write(d / "cases" / case_page_name(case["id"]), text)
                    page = True
            rows.append((case, why, page))
    finally:
        if own:
            st.close()
    index = d / "index.html"
    _write(index, _index(results, rows))
    return index


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def report_from_files(results_path: str | os.PathLike, store_path: str | os.PathLike,
                      out: str | os.PathLike) -> Path:
    """``tensorverse report html``: the report from a results file and the replay's ``--store``."""
    results = json.loads(Path(results_path).read_text(encoding="utf-8"))
    if results.get("format") != RESULTS_FORMAT:
        raise ValueError(f"{results_path}: not a Tensorverse replay results file")
    return write_html_report(results, store_path, out)
