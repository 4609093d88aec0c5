"""Replay results: the results file, the terminal summary, ``--fail-on`` gates, and merging the
results of many rigs (``tensorverse report merge``).

Results file (``format: tensorverse.replay-results``, version 1)::

    {"format", "format_version", "created", "tensorverse_version",
     "corpus": {"name", "cases", "manifest_sha256", "tokenizer"},
     "rig": {"host": {...}, "backends": {NAME: doctor's view}},      # no URLs, no prompt text
     "backends": [{"name", "model", "role", "capture"}], "reference", "modes",
     "tokenizers": {NAME: {"fingerprint", "corpus", "same_dictionary"}}, "refused": {NAME: why},
     "summary": {NAME: {... see summarize_backend ...}},
     "cases": [{"id", "session", "turns": [{"index", "positions", "basis": {"source", "backend",
                "tokens", "vs_recorded"}, "backends": {NAME: {"forced", "free"}}}],
                "branches": {NAME: {"status", "turn", ...}}}],
     "thresholds": {"rules", "failed"}, "wall_s", "resumed"}

No prompt or output text is written unless ``--include-text``.

Summary per backend (vs the reference's forced run for forced metrics, vs the basis for free
ones; the reference's own free row is vs the recorded output, see
:mod:`tensorverse.replay.runner`): ``positions``, ``flips``, ``flip_rate`` with its 95 % interval
(``flip_rate_ci``), ``same_top_p`` (p, se), ``kl`` (mean, max, percentiles over positions),
``first_flip`` (median over turns with one), ``departures`` (forced top-1 != the basis token) and
``departure_rate``, ``flips_by_class`` (forced and free flips by class: tie, near_tie, noise,
parser, runtime; docs/attribution.md), ``runtime_flip_rate`` (forced runtime-class flips per
position) with its interval, free ``turns``, ``diverged``, ``verdicts`` (counts),
``toolcall_mismatch_rate`` (free turns whose verdict is not ``match``), branch outcomes
(``completed``/``diverged``/``simulated``), ``errors`` and ``error_rate``, and ``turn_counts``
(per forced turn: positions, flips, runtime flips, departures).

Intervals (:mod:`tensorverse.analysis.intervals`): the per-position rates (flip, runtime flip,
departure) have the turn-clustered bootstrap interval, the turn being the unit (None with fewer
than two turns); the tool-call mismatch rate, counted per free turn, has the Wilson interval.
The matrix report's marginals and the hypercube site give the same interval for the same turns.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import operator
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tensorverse.analysis.intervals import cluster_bootstrap, wilson

RESULTS_FORMAT = "tensorverse.replay-results"  # the results file (format_version RESULTS_VERSION)
RESULTS_VERSION = 1

__all__ = ["build_results", "summarize_backend", "render_summary", "parse_threshold",
           "check_thresholds", "merge_results", "render_merged", "METRICS"]

METRICS = ("flip_rate", "runtime_flip_rate", "toolcall_mismatch_rate", "same_top_p", "kl_mean", "kl_max",
           "departure_rate", "diverged_rate", "error_rate", "flips", "errors")
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
        "==": operator.eq, "!=": operator.ne}
_PCTS = (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1)


def turn_counts(name: str, cases: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (case, turn) whose forced run of ``name`` compared: ``positions``, ``flips``,
    ``runtime_flips``, ``departures`` and ``departure_positions``: the clusters of every
    per-position rate's interval (the turn is the unit, :mod:`tensorverse.analysis.intervals`)."""
    out = []
    for c in cases:
        for t in c.get("turns") or ():
            f = ((t.get("backends") or {}).get(name) or {}).get("forced")
            if not f or f.get("status") != "ok":
                continue
            compared = f.get("n") is not None  # as summarize_backend counts: flips only where compared
            classes = (f.get("flip_classes") or ()) if compared else ()
            dep = f.get("departures")
            out.append({"case": c.get("id"), "turn": t.get("index"), "positions": int(f["n"]) if compared else 0,
                        "flips": len(f.get("flips") or ()) if compared else 0,
                        "runtime_flips": sum(k == "runtime" for k in classes),
                        "departures": len(dep) if dep is not None else 0,
                        "departure_positions": (t.get("positions") or 0) if dep is not None else 0})
    return out


def clustered_ci(counts: Sequence[Mapping[str, Any]], numerator: str, denominator: str = "positions") -> list[float] | None:
    """The turn-clustered 95 % interval of ``sum(numerator) / sum(denominator)`` over
    :func:`turn_counts` entries, as ``[low, high]`` (None with fewer than two turns)."""
    rows = [c for c in counts if c[denominator]]
    return cluster_bootstrap([c[numerator] for c in rows], [c[denominator] for c in rows]).bounds()


def _wilson(k: int, n: int) -> list[float] | None:
    ci = wilson(k, n)
    return None if ci is None else [round(ci[0], 6), round(ci[1], 6)]


def summarize_backend(name: str, cases: Sequence[Mapping[str, Any]], *, is_reference: bool) -> dict[str, Any]:
    positions = flips = agree = dep = dep_n = 0
    kl: list[float] = []
    first: list[int] = []
    free_turns = diverged = 0
    verdicts: dict[str, int] = {}
    errors = runs = 0
    branches: dict[str, int] = {}
    kinds: set[str] = set()
    by_class: dict[str, int] = {}
    runtime = 0
    for c in cases:
        b = (c.get("branches") or {}).get(name)
        if b:
            branches[b["status"]] = branches.get(b["status"], 0) + 1
        for t in c.get("turns") or ():
            r = (t.get("backends") or {}).get(name)
            if not r:
                continue
            f = r.get("forced")
            if f:
                runs += 1
                if f.get("status") != "ok":
                    errors += 1
                else:
                    if f.get("departures") is not None:
                        dep += len(f["departures"])
                        dep_n += t.get("positions") or 0
                    if f.get("n") is not None:
                        positions += f["n"]
                        flips += len(f.get("flips") or ())
                        for k in f.get("flip_classes") or ():
                            by_class[k] = by_class.get(k, 0) + 1
                            runtime += k == "runtime"
                        agree += f.get("top1_agree") or 0
                        kl.extend(x for x in f.get("kl") or () if x is not None and math.isfinite(x))
                        if f.get("kind"):
                            kinds.add(f["kind"])
                        if f.get("first_flip") is not None:
                            first.append(f["first_flip"])
            fr = r.get("free")
            if fr:
                runs += 1
                if fr.get("status") != "ok":
                    errors += 1
                elif fr.get("verdict") is not None:
                    free_turns += 1
                    diverged += bool(fr.get("diverged"))
                    verdicts[fr["verdict"]] = verdicts.get(fr["verdict"], 0) + 1
                    if fr.get("flip_class"):
                        by_class[fr["flip_class"]] = by_class.get(fr["flip_class"], 0) + 1
    out: dict[str, Any] = {"backend": name, "reference": is_reference, "positions": positions,
                           "flips": flips}
    counts = turn_counts(name, cases)
    if positions:
        p = agree / positions
        out["flip_rate"] = flips / positions
        out["flip_rate_ci"] = clustered_ci(counts, "flips")
        out["runtime_flip_rate"] = runtime / positions
        out["runtime_flip_rate_ci"] = clustered_ci(counts, "runtime_flips")
        out["same_top_p"] = {"p": p, "se": math.sqrt(p * (1 - p) / (positions - 1)) if positions > 1 else None}
    else:
        out.update(flip_rate=None, flip_rate_ci=None, runtime_flip_rate=None, runtime_flip_rate_ci=None,
                   same_top_p=None)
    if kl:
        a = np.asarray(kl, dtype=np.float64)
        out["kl"] = {"mean": float(a.mean()), "max": float(a.max()),
                     **{f"p{str(q).replace('.', '_')}": float(np.percentile(a, q)) for q in _PCTS},
                     "min": float(a.min()), "approximate": kinds != {"full"}}
    else:
        out["kl"] = None
    from tensorverse.analysis.attribution import FLIP_CLASSES

    out["flips_by_class"] = {k: by_class.get(k, 0) for k in FLIP_CLASSES}
    out["runtime_flips"] = runtime
    out["first_flip"] = float(np.median(first)) if first else None
    out["turns_with_flips"] = len(first)
    out["departures"] = dep
    out["departure_rate"] = dep / dep_n if dep_n else None
    out["departure_rate_ci"] = clustered_ci(counts, "departures", "departure_positions")
    out["free_turns"] = free_turns
    out["diverged"] = diverged
    out["diverged_rate"] = diverged / free_turns if free_turns else None
    out["verdicts"] = dict(sorted(verdicts.items()))
    mism = sum(v for k, v in verdicts.items() if k != "match")
    out["toolcall_mismatch_rate"] = mism / free_turns if free_turns else None
    out["toolcall_mismatch_rate_ci"] = _wilson(mism, free_turns)  # free turns: independent trials
    out["turn_counts"] = counts
    out["branches"] = branches
    out["errors"] = errors
    out["error_rate"] = errors / runs if runs else None
    return out


def build_results(corpus: Any, opts: Any, cases: Sequence[Mapping[str, Any]], *, rig: Mapping[str, Any],
                  tokenizers: Mapping[str, Any], refused: Mapping[str, str], wall_s: float,
                  resumed: int = 0) -> dict[str, Any]:
    from tensorverse.replay.corpus import _version

    mpath = Path(corpus.path) / "corpus.json"
    sha = hashlib.sha256(mpath.read_bytes()).hexdigest() if mpath.is_file() else None
    summary = {b.name: summarize_backend(b.name, cases, is_reference=b.name == opts.reference)
               for b in opts.backends}
    return {
        "format": RESULTS_FORMAT,
        "format_version": RESULTS_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tensorverse_version": _version(),
        "corpus": {"name": corpus.manifest.get("name") or Path(corpus.path).name,
                   "cases": len(corpus.cases), "manifest_sha256": sha,
                   "tokenizer": (corpus.tokenizer or {}).get("fingerprint")},
        "rig": dict(rig),
        "backends": [{"name": b.name, "model": b.model, "role": b.role, "capture": b.capture}
                     for b in opts.backends],
        "reference": opts.reference,
        "modes": list(opts.modes),
        "tokenizers": dict(tokenizers),
        "refused": dict(refused),
        "include_text": bool(opts.include_text),
        "summary": summary,
        "cases": list(cases),
        "wall_s": round(wall_s, 3),
        "resumed": resumed,
    }


# ------------------------------------------------------------------------------------- terminal


def _fmt(v: Any, spec: str = ".4f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def format_table(rows: list[list[str]]) -> str:
    """Rows of cells as aligned columns (first left, the rest right), a rule under the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _summary_rows(summary: Mapping[str, Mapping[str, Any]], label: Callable | None = None) -> list[list[str]]:
    rows = [["backend", "positions", "same_top_p", "flip_rate [95% CI]", "flips by class", "KL mean", "KL p99",
             "KL max", "1st flip", "departures", "free", "verdicts", "branches", "errors"]]
    for name, s in summary.items():
        stp = s.get("same_top_p")
        ci = s.get("flip_rate_ci")
        kl = s.get("kl") or {}
        rows.append([
            (label(name) if label else name) + (" (ref)" if s.get("reference") else ""),
            str(s.get("positions", 0)),
            f"{stp['p'] * 100:.2f}% ± {stp['se'] * 100:.2f}" if stp and stp.get("se") is not None
            else (f"{stp['p'] * 100:.2f}%" if stp else "-"),
            f"{s['flip_rate']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]" if s.get("flip_rate") is not None and ci else "-",
            " ".join(f"{k}={v}" for k, v in (s.get("flips_by_class") or {}).items() if v) or "-",
            _fmt(kl.get("mean"), ".2e"), _fmt(kl.get("p99"), ".2e"), _fmt(kl.get("max"), ".2e"),
            _fmt(s.get("first_flip"), ".0f"),
            f"{s.get('departures', 0)}" + (f" ({s['departure_rate']:.4f})" if s.get("departure_rate") is not None else ""),
            f"{s.get('diverged', 0)}/{s.get('free_turns', 0)}",
            " ".join(f"{k}={v}" for k, v in (s.get("verdicts") or {}).items()) or "-",
            " ".join(f"{k}={v}" for k, v in (s.get("branches") or {}).items()) or "-",
            str(s.get("errors", 0)),
        ])
    return rows


def render_summary(results: Mapping[str, Any]) -> str:
    s = results["summary"]
    head = (f"replay of {results['corpus']['cases']} case(s) from {results['corpus']['name']} "
            f"on {len(s)} backend(s); forced metrics vs {results['reference']}'s forced run, free vs the "
            f"basis ({results['reference']}'s own run; its own free row: vs the recorded output); "
            f"{results.get('wall_s', 0):.1f} s")
    out = [head, format_table(_summary_rows(s))]
    if any((v or {}).get("kl", {}) and v["kl"].get("approximate") for v in s.values() if v.get("kl")):
        out.append("KL from top-k logprobs (approximate); full rows need --capture full and a sink.")
    turns = [t for c in results.get("cases") or () for t in c.get("turns") or ()]
    basis = [t.get("basis") or {} for t in turns]
    if basis:
        changed = sum(1 for b in basis if (b.get("vs_recorded") or {}).get("diverged"))
        fallback = sum(1 for b in basis if b.get("source") == "recorded")
        out.append(f"basis: {changed}/{len(basis)} turn(s) differ from the recorded output"
                   + (f"; {fallback} fell back to the recorded output" if fallback else ""))
    for name, why in (results.get("refused") or {}).items():
        out.append(f"{name}: {why}")
    return "\n".join(out)


# ----------------------------------------------------------------------------------- thresholds

_THRESH = re.compile(r"^\s*(?:(?P<backend>[\w.-]+):)?(?P<metric>[a-z_]+)\s*(?P<op>>=|<=|==|!=|>|<)\s*"
                     r"(?P<value>[-+0-9.eE]+)\s*$")


_VERDICT_RULE = re.compile(r"^\s*(?:(?P<backend>[\w.-]+):)?verdict\s*(?P<op>==|=|!=)\s*(?P<value>[a-z]+)\s*$")


def parse_threshold(spec: str) -> dict[str, Any]:
    """``'flip_rate>0.01'``, ``'fp8:toolcall_mismatch_rate>0'``, ``'fp8:verdict=regression'``
    (docs/verdict.md) -> a rule. Rules without a backend apply to every backend except the
    reference."""
    from tensorverse.analysis.verdict import DECISIONS

    v = _VERDICT_RULE.match(spec)
    if v:
        if v["value"] not in DECISIONS:
            raise ValueError(f"--fail-on {spec!r}: a verdict is one of {', '.join(DECISIONS)}")
        return {"spec": spec.strip(), "backend": v["backend"], "metric": "verdict",
                "op": "!=" if v["op"] == "!=" else "==", "value": v["value"]}
    m = _THRESH.match(spec)
    if not m:
        raise ValueError(f"--fail-on {spec!r}: use [BACKEND:]METRIC OP NUMBER, e.g. 'flip_rate>0.01', "
                         "or [BACKEND:]verdict=DECISION, e.g. 'fp8:verdict=regression'")
    if m["metric"] not in METRICS:
        raise ValueError(f"--fail-on {spec!r}: unknown metric {m['metric']!r} (one of {', '.join(METRICS)})")
    try:
        value = float(m["value"])
    except ValueError:
        raise ValueError(f"--fail-on {spec!r}: {m['value']!r} is not a number") from None
    return {"spec": spec.strip(), "backend": m["backend"], "metric": m["metric"], "op": m["op"], "value": value}


def _metric(s: Mapping[str, Any], metric: str) -> float | None:
    if metric == "same_top_p":
        return (s.get("same_top_p") or {}).get("p")
    if metric in ("kl_mean", "kl_max"):
        return (s.get("kl") or {}).get(metric[3:])
    v = s.get(metric)
    return float(v) if isinstance(v, (int, float)) else None


def check_thresholds(results: Mapping[str, Any], rules: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rules that the results break (a metric that could not be measured breaks nothing,
    but a named backend that is missing does)."""
    failed = []
    summary = results["summary"]
    decisions = {v["backend"]: v["decision"] for v in (results.get("verdict") or {}).get("shadows") or ()}
    for rule in rules:
        names = [rule["backend"]] if rule["backend"] else [n for n, s in summary.items() if not s.get("reference")]
        for name in names:
            s = summary.get(name)
            if s is None:
                failed.append({**rule, "backend": name, "actual": None,
                               "message": f"{rule['spec']}: no backend {name!r} in the results"})
                continue
            if rule["metric"] == "verdict":
                d = decisions.get(name)
                if d is not None and (d == rule["value"]) == (rule["op"] == "=="):
                    failed.append({**rule, "backend": name, "actual": d,
                                   "message": f"{name}: verdict = {d} ({rule['spec']})"})
                continue
            v = _metric(s, rule["metric"])
            if v is not None and _OPS[rule["op"]](v, rule["value"]):
                failed.append({**rule, "backend": name, "actual": v,
                               "message": f"{name}: {rule['metric']} = {v:.6g} ({rule['spec']})"})
    return failed


# ---------------------------------------------------------------------------------------- merge

_SUMS = ("positions", "flips", "runtime_flips", "departures", "free_turns", "diverged", "errors",
         "turns_with_flips")


def merge_results(paths: Sequence[str | Path]) -> dict[str, Any]:
    """Aggregate results files from many rigs: one row per (rig, backend), plus the totals per
    backend name. Counts add up exactly; KL keeps the mean (weighted by positions) and the max."""
    rows = []
    for p in paths:
        r = json.loads(Path(p).read_text(encoding="utf-8"))
        if r.get("format") != RESULTS_FORMAT:
            raise ValueError(f"{p}: not a Tensorverse replay results file")
        host = (r.get("rig") or {}).get("host") or {}
        gpus = host.get("gpus") or {}
        rig = (", ".join(gpus.get("models") or []) + f" x{gpus.get('count')}") if gpus else (host.get("machine") or "cpu")
        for name, s in r["summary"].items():
            binfo = ((r.get("rig") or {}).get("backends") or {}).get(name) or {}
            # ``reference``: this backend was the file's reference (the summary's flag);
            # ``reference_backend``: the file's reference backend's name
            # turn counts: the summary's, or (a results file older than them) from its cases
            counts = s.get("turn_counts")
            if counts is None:
                counts = turn_counts(name, r.get("cases") or ())
            rows.append({**s, "turn_counts": counts, "file": str(p), "rig": rig, "backend": name,
                         "vllm": binfo.get("version"),
                         "model": binfo.get("model"), "reference": name == r.get("reference"),
                         "reference_backend": r.get("reference"),
                         "corpus": (r.get("corpus") or {}).get("manifest_sha256"),
                         "corpus_name": (r.get("corpus") or {}).get("name")})
    totals: dict[str, dict[str, Any]] = {}
    for row in rows:
        t = totals.setdefault(row["backend"], {"backend": row["backend"], "rigs": 0, "verdicts": {},
                                               **{k: 0 for k in _SUMS}, "_klw": 0.0, "kl_max": None, "_turns": []})
        t["rigs"] += 1
        t["_turns"].extend(row["turn_counts"])  # each (file, case, turn) one cluster
        for k in _SUMS:
            t[k] += row.get(k) or 0
        for v, n in (row.get("verdicts") or {}).items():
            t["verdicts"][v] = t["verdicts"].get(v, 0) + n
        for k, n in (row.get("flips_by_class") or {}).items():
            t.setdefault("flips_by_class", {})[k] = t.get("flips_by_class", {}).get(k, 0) + n
        kl = row.get("kl") or {}
        if kl.get("mean") is not None:
            t["_klw"] += kl["mean"] * (row.get("positions") or 0)
            t["kl_max"] = kl["max"] if t["kl_max"] is None else max(t["kl_max"], kl["max"])
    for t in totals.values():
        n = t["positions"]
        t["flip_rate"] = t["flips"] / n if n else None
        t["flip_rate_ci"] = clustered_ci(t.pop("_turns"), "flips")
        t["runtime_flip_rate"] = t["runtime_flips"] / n if n else None
        t["kl_mean"] = t.pop("_klw") / n if n else None
        mism = sum(v for k, v in t["verdicts"].items() if k != "match")
        t["toolcall_mismatch_rate"] = mism / t["free_turns"] if t["free_turns"] else None
    corpora = {row["corpus"] for row in rows}
    return {"format": "tensorverse.replay-merge", "format_version": 1, "files": [str(p) for p in paths],
            "same_corpus": len(corpora) == 1, "rows": rows, "totals": totals}


def render_merged(merged: Mapping[str, Any]) -> str:
    rows = [["rig", "corpus", "backend", "vllm", "positions", "flip_rate", "KL mean", "verdicts", "errors"]]
    for r in merged["rows"]:
        kl = r.get("kl") or {}
        rows.append([r["rig"], str(r.get("corpus_name") or "-"),
                     r["backend"] + (" (ref)" if r.get("reference") is True else ""),
                     str(r.get("vllm") or "-"), str(r.get("positions", 0)), _fmt(r.get("flip_rate")),
                     _fmt(kl.get("mean"), ".2e"),
                     " ".join(f"{k}={v}" for k, v in (r.get("verdicts") or {}).items()) or "-",
                     str(r.get("errors", 0))])
    out = [format_table(rows)]
    if not merged.get("same_corpus"):
        out.append("note: the files replayed different corpora (manifest hashes differ)")
    return "\n".join(out)


def write_parquet(merged: Mapping[str, Any], path: str | Path) -> Path:
    """The merged rows as Parquet (pyarrow), nested values as JSON strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for r in merged["rows"]:
        rows.append({k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in r.items()})
    cols = sorted({k for r in rows for k in r})
    table = pa.table({c: [r.get(c) for r in rows] for c in cols})
    pq.write_table(table, str(path))
    return Path(path)

