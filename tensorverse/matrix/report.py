"""The hypercube report: per point the replay summary against the reference point, per axis the
marginal effect; as JSON (``matrix.json``), a terminal table, Parquet (one row per point,
``matrix.parquet``), an HTML page with a heat map (:mod:`tensorverse.matrix.html`), and a results
file in replay's own format (``replay-results.json``, every point a backend) so that
``tensorverse report merge`` aggregates matrices with rig reports from other
machines.

``matrix.json`` (``format: tensorverse.matrix-results``, version 1)::

    {"format", "format_version", "created", "tensorverse_version", "model", "served_name",
     "corpus": {"path", "name", "cases", "manifest_sha256"}, "reference", "axes": {KEY: [values]},
     "points": [{"name", "settings", "effective", "key", "reference", "status", "error",
                 "log_excerpt", "timings": {"start_s", "replay_s", "rows_wait_s", "compare_s",
                 "stop_s", "total_s"}, "summary": {replay's summary}, "free_vs_reference":
                 {"turns", "diverged", "verdicts"}}],
     "marginals": {KEY: [{"value", "points", "positions", "flips", "flip_rate", "flip_rate_ci",
                          "mean_point_flip_rate", "kl_mean", "toolcall_mismatch_rate", "effect", "effect_ci"}]},
     "wall_s"}

No prompt or output text is written (the run directories' stores hold the rows and texts).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from tensorverse.matrix.hypercube import marginals
from tensorverse.matrix.spec import MatrixSpec, Point, render_value
from tensorverse.replay.report import RESULTS_FORMAT, RESULTS_VERSION, format_table

__all__ = ["build_report", "write_outputs", "render_table", "replay_results", "write_parquet"]

FORMAT = "tensorverse.matrix-results"


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("tensorverse")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return None


def build_report(spec: MatrixSpec, corpus_path: str, out: Path, points: Sequence[Point],
                 runs: Mapping[str, Mapping[str, Any]], *, wall_s: float) -> dict[str, Any]:
    """Compare every captured point with the reference point and summarize (reads the runs'
    stores; writes nothing)."""
    from tensorverse.matrix.compare import point_cases
    from tensorverse.matrix.run import corpus_sha
    from tensorverse.replay.corpus import load_corpus
    from tensorverse.replay.report import summarize_backend

    corpus = load_corpus(corpus_path)
    ref = spec.reference
    ref_run = runs.get(ref) or {}
    ref_key = ref_run.get("key") if ref_run.get("status") == "ok" else None
    rows: list[dict[str, Any]] = []
    all_cases: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        run = runs.get(p.name) or {}
        row: dict[str, Any] = {"name": p.name, "settings": p.settings, "effective": run.get("effective"),
                               "key": run.get("key"), "reference": p.name == ref,
                               "status": run.get("status") or "not_run",
                               "timings": dict(run.get("timings") or {})}
        if run.get("status") != "ok":
            row.update(error=run.get("error"), log_excerpt=run.get("log_excerpt"))
            rows.append(row)
            continue
        if p.name != ref and ref_key is None:
            row["error"] = (f"the reference point {ref!r} did not run ({ref_run.get('status')}): "
                            "no forced comparison; free runs compared with the recorded output")
        t0 = time.monotonic()
        cases = point_cases(out, corpus, ref_key if p.name != ref else None, run["key"], p.name, ref,
                            list(run["cases"]))
        row["timings"]["compare_s"] = round(time.monotonic() - t0, 3)
        all_cases[p.name] = cases
        s = summarize_backend(p.name, cases, is_reference=p.name == ref)
        row["summary"] = s
        row["free_vs_reference"] = ({"turns": s.get("free_turns"), "diverged": s.get("diverged"),
                                     "verdicts": s.get("verdicts")} if p.name != ref and ref_key else None)
        row["run_errors"] = run.get("n_run_errors")
        row["vllm"] = run.get("vllm")
        row["host"] = run.get("host")
        rows.append(row)
    axes = spec.axis_values()
    m = marginals([{**r, "effective": r.get("effective") or spec.effective(r["settings"])} for r in rows], axes)
    report = {
        "format": FORMAT, "format_version": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tensorverse_version": _version(),
        "model": spec.model.path, "served_name": spec.served_name,
        "corpus": {"path": str(corpus_path), "name": corpus.manifest.get("name") or Path(corpus_path).name,
                   "cases": len(corpus.cases), "manifest_sha256": corpus_sha(corpus_path)},
        "reference": ref, "modes": list(spec.replay.modes), "axes": axes,
        "grid_axes": list(spec.axes), "points": rows,
        "marginals": m, "wall_s": round(wall_s, 3),
    }
    report["_cases"] = all_cases  # for replay_results; not written into matrix.json
    return report


def replay_results(report: Mapping[str, Any]) -> dict[str, Any]:
    """The matrix as one replay results file: every captured point is a backend."""
    ok = [r for r in report["points"] if r.get("status") == "ok"]
    cases_by_id: dict[str, dict[str, Any]] = {}
    for r in ok:
        for c in report.get("_cases", {}).get(r["name"], ()):
            dst = cases_by_id.setdefault(c["id"], {"id": c["id"], "turns": [], "branches": {}})
            dst["branches"].update(c.get("branches") or {})
            for t in c.get("turns") or ():
                tt = next((x for x in dst["turns"] if x["index"] == t["index"]), None)
                if tt is None:
                    tt = {"index": t["index"], "positions": t.get("positions"), "backends": {}}
                    dst["turns"].append(tt)
                tt["backends"].update(t.get("backends") or {})
    host = next((r.get("host") for r in ok if r.get("host")), None)
    return {
        "format": RESULTS_FORMAT, "format_version": RESULTS_VERSION, "created": report["created"],
        "tensorverse_version": report["tensorverse_version"],
        "corpus": {"name": report["corpus"]["name"], "cases": report["corpus"]["cases"],
                   "manifest_sha256": report["corpus"]["manifest_sha256"], "tokenizer": None},
        "rig": {"host": host, "backends": {r["name"]: {"version": r.get("vllm"), "model": report["served_name"],
                                                       "capture": "full", "plugin": True,
                                                       "launch_options": r.get("effective")} for r in ok}},
        "backends": [{"name": r["name"], "model": report["served_name"],
                      "role": "reference" if r["reference"] else "shadow", "capture": "full"} for r in ok],
        "reference": report["reference"], "modes": report.get("modes", ["forced", "free"]),
        "tokenizers": {}, "refused": {}, "include_text": False,
        "summary": {r["name"]: r["summary"] for r in ok},
        "cases": list(cases_by_id.values()), "wall_s": report.get("wall_s"), "resumed": 0,
        "matrix": {"axes": report["axes"], "points": {r["name"]: r["settings"] for r in ok}},
    }


def _flat(row: Mapping[str, Any], axes: Mapping[str, Any]) -> dict[str, Any]:
    s = row.get("summary") or {}
    eff = row.get("effective") or {}
    t = row.get("timings") or {}
    kl = s.get("kl") or {}
    stp = s.get("same_top_p") or {}
    out: dict[str, Any] = {"point": row["name"], "reference": bool(row.get("reference")),
                           "status": row["status"]}
    for k in axes:
        v = eff.get(k, row["settings"].get(k))
        out[f"axis:{k}"] = None if v is None else render_value(v)
    out.update({
        "positions": s.get("positions"), "flips": s.get("flips"), "flip_rate": s.get("flip_rate"),
        "flip_rate_lo": (s.get("flip_rate_ci") or [None, None])[0],
        "flip_rate_hi": (s.get("flip_rate_ci") or [None, None])[1],
        "runtime_flip_rate": s.get("runtime_flip_rate"),
        "flips_by_class": json.dumps(s.get("flips_by_class") or {}),
        "same_top_p": stp.get("p"), "kl_mean": kl.get("mean"), "kl_p99": kl.get("p99"),
        "kl_max": kl.get("max"), "first_flip": s.get("first_flip"),
        "toolcall_mismatch_rate": s.get("toolcall_mismatch_rate"),
        "verdicts": json.dumps(s.get("verdicts") or {}),
        "free_vs_reference": json.dumps(row.get("free_vs_reference") or {}),
        "errors": s.get("errors"), "error": row.get("error"),
        "start_s": t.get("start_s"), "replay_s": t.get("replay_s"), "rows_wait_s": t.get("rows_wait_s"),
        "compare_s": t.get("compare_s"), "stop_s": t.get("stop_s"),
    })
    return out


def write_parquet(report: Mapping[str, Any], path: Path) -> Path:
    """One row per point (axis values as ``axis:KEY`` columns), for pandas/DuckDB."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_flat(r, report["axes"]) for r in report["points"]]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    pq.write_table(pa.table({c: [r.get(c) for r in rows] for c in cols}), str(path))
    return path


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_outputs(report: dict[str, Any], out: Path) -> dict[str, Path]:
    """matrix.json, replay-results.json, matrix.parquet, matrix.html."""
    from tensorverse.matrix.html import render_html

    paths = {"json": out / "matrix.json", "replay": out / "replay-results.json",
             "parquet": out / "matrix.parquet", "html": out / "matrix.html"}
    _write_json(paths["replay"], replay_results(report))
    _write_json(paths["json"], {k: v for k, v in report.items() if not k.startswith("_")})
    write_parquet(report, paths["parquet"])
    paths["html"].write_text(render_html(report), encoding="utf-8")
    return paths


# ------------------------------------------------------------------------------------ terminal


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _effect(v: Mapping[str, Any]) -> str:
    """A marginal's effect with its paired interval (``+0.0859 [+0.0487, +0.1473]``)."""
    e, ci = v.get("effect"), v.get("effect_ci")
    if e is None:
        return "-"
    return f"{e:+.4f}" + (f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "")


def render_table(report: Mapping[str, Any]) -> str:
    """Points (status, flip rate with CI, same_top_p, KL, free divergence vs the reference,
    timings), then one block per axis with its marginal effect."""
    head = (f"matrix of {len(report['points'])} point(s) over {report['corpus']['cases']} case(s) of "
            f"{report['corpus']['name']}; forced vs {report['reference']!r}; {report['wall_s']:.0f} s")
    rows = [["point", "status", "positions", "flip_rate [95% CI]", "flips by class", "same_top_p", "KL mean",
             "KL max", "1st flip", "free div/ref", "verdicts/ref", "start s", "replay s"]]
    for r in report["points"]:
        s = r.get("summary") or {}
        ci = s.get("flip_rate_ci")
        fv = r.get("free_vs_reference") or {}
        t = r.get("timings") or {}
        rows.append([
            r["name"] + (" (ref)" if r.get("reference") else ""), r["status"], str(s.get("positions", "-")),
            f"{s['flip_rate']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]" if s.get("flip_rate") is not None and ci else "-",
            " ".join(f"{k}={v}" for k, v in (s.get("flips_by_class") or {}).items() if v) or "-",
            f"{s['same_top_p']['p'] * 100:.2f}%" if s.get("same_top_p") else "-",
            _f((s.get("kl") or {}).get("mean"), ".2e"), _f((s.get("kl") or {}).get("max"), ".2e"),
            _f(s.get("first_flip"), ".0f"),
            f"{fv.get('diverged', 0)}/{fv.get('turns', 0)}" if fv.get("turns") else "-",
            " ".join(f"{k}={v}" for k, v in (fv.get("verdicts") or {}).items()) or "-",
            _f(t.get("start_s"), ".0f"), _f(t.get("replay_s"), ".0f"),
        ])
    out = [head, format_table(rows)]
    for r in report["points"]:
        if r["status"] not in ("ok",):
            excerpt = (r.get("log_excerpt") or "").strip().splitlines()[-3:]
            out.append(f"{r['name']}: {r['status']}: {r.get('error')}"
                       + ("".join(f"\n    | {ln}" for ln in excerpt)))
        elif r.get("error"):
            out.append(f"{r['name']}: {r['error']}")
    for axis, vals in (report.get("marginals") or {}).items():
        mrows = [[axis, "points", "positions", "flip_rate [95% CI]", "mean point rate", "KL mean",
                  "tool mismatch", "effect [95% CI]"]]
        for v in vals:
            ci = v.get("flip_rate_ci")
            mrows.append([render_value(v["value"]), str(len(v["points"])), str(v["positions"]),
                          f"{v['flip_rate']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]" if v.get("flip_rate") is not None and ci else "-",
                          _f(v.get("mean_point_flip_rate"), ".4f"), _f(v.get("kl_mean"), ".2e"),
                          _f(v.get("toolcall_mismatch_rate"), ".3f"), _effect(v)])
        out.append("")
        out.append(format_table(mrows))
    return "\n".join(out)
