"""`tensorverse analyze`: per-position metrics and the run summary for two logits matrices.

``analyze`` and ``render_table`` are pure; the loaders and ``run_analyze`` (the CLI entry)
are the only places in the analysis package that touch files.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Sequence

import numpy as np

from tensorverse.analysis.attribution import (
    DEFAULT_RULE,
    FlipAttribution,
    TieRule,
    classify_forced,
    flips_by_class,
    noise_flips,
)
from tensorverse.analysis.flips import forced_flips
from tensorverse.analysis.metrics import (
    PERCENTILES,
    AnalysisInputError,
    PositionMetrics,
    position_metrics,
    summarize,
)

__all__ = ["analyze", "result_from_metrics", "render_table", "load_logits", "load_tokens",
           "run_analyze"]

# Tables longer than this show the flips and the highest-KL positions only.
_TABLE_ALL = 64
_TABLE_TOP = 20


def result_from_metrics(m: PositionMetrics, regions: Sequence[str] | None = None,
                        vocab: int | None = None,
                        attributions: Sequence[FlipAttribution] | None = None) -> dict[str, Any]:
    """The analyze result for metrics already computed (exact or approximate).

    ``attributions``: the classified flips (:mod:`tensorverse.analysis.attribution`); each
    position then carries ``flip_class`` (None where it does not flip) and the summary
    ``flips_by_class``."""
    summary = summarize(m, regions)
    positions = m.rows()
    if regions is not None:
        for row, reg in zip(positions, regions):
            row["region"] = reg
    if attributions is not None:
        by_pos = {a.position: a for a in attributions}
        for row in positions:
            a = by_pos.get(row["position"])
            row["flip_class"] = a.flip_class.value if a is not None else None
        summary["flips_by_class"] = flips_by_class(attributions)
    return {
        "mode": "forced",
        "n": m.n,
        "vocab": vocab,
        "approximate": bool(m.approximate),
        "flips": forced_flips(m),
        "positions": positions,
        "summary": summary,
    }


def analyze(ref: np.ndarray, cand: np.ndarray, tokens: Sequence[int] | np.ndarray,
            regions: Sequence[str] | None = None, noise: np.ndarray | None = None,
            rule: TieRule = DEFAULT_RULE) -> dict[str, Any]:
    """Per-position metrics, the summary and the class of every flip of a reference and a
    candidate logits matrix.

    ``noise``: the rows of a noise run at the same positions (e.g. the secondary's): a flip
    where the noise run's argmax also differs from the reference's is ``noise`` (without it,
    no flip is). Returns ``{"mode", "n", "vocab", "approximate", "flips", "positions",
    "summary", "attribution"}``; ``positions`` is :meth:`PositionMetrics.rows` plus
    ``flip_class`` (and ``region`` when given)."""
    m = position_metrics(ref, cand, tokens)
    vocab = int(np.shape(ref)[-1])
    noise_mask = None
    if noise is not None:
        noise_m = _as_noise(noise, np.shape(ref))
        noise_mask = noise_flips(m.ref_top1, np.argmax(noise_m, axis=1))
    attributions = classify_forced(ref, m.ref_top1, m.cand_top1, noise=noise_mask, rule=rule)
    result = result_from_metrics(m, regions, vocab, attributions)
    result["attribution"] = {"rule": rule.as_dict(), "noise": noise is not None}
    return result


def _as_noise(noise: Any, shape: tuple[int, ...]) -> np.ndarray:
    a = np.asarray(noise)
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if a.dtype.kind != "f":
        raise AnalysisInputError(f"noise: logits must be a floating dtype, got {a.dtype}", "dtype")
    if a.shape != tuple(shape):
        raise AnalysisInputError(f"noise: shape {a.shape} differs from the reference's {tuple(shape)}", "shape")
    return a


# --------------------------------------------------------------------------- rendering


def _f(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, fmt)


def _pm(mean: Any, se: Any, fmt: str, scale: float = 1.0) -> str:
    if mean is None:
        return "n/a"
    s = format(mean * scale, fmt)
    if se is not None:
        s += " ± " + format(se * scale, fmt)
    return s


def _pct_label(p: float) -> str:
    return "Median " if p == 50.0 else f"{p:4.1f}%  "


def render_table(result: dict[str, Any]) -> str:
    """A human-readable report: a per-position table, then the llama.cpp-style summary."""
    s = result["summary"]
    rows = result["positions"]
    n = result.get("n", len(rows))
    lines: list[str] = []
    head = f"{n} positions"
    if result.get("vocab"):
        head += f" x {result['vocab']} vocabulary"
    if result.get("approximate"):
        head += " (APPROXIMATE: top-k logprobs only)"
    lines.append(head)
    lines.append("")

    shown = rows
    note = ""
    if len(rows) > _TABLE_ALL:
        flips = {r["position"] for r in rows if r["flip"]}
        by_kl = sorted(rows, key=lambda r: -(r["kl"] if r["kl"] == r["kl"] else -1.0))
        keep = flips | {r["position"] for r in by_kl[:_TABLE_TOP]}
        shown = [r for r in rows if r["position"] in keep]
        note = f"(showing {len(shown)} of {len(rows)} positions: every flip and the " \
               f"{_TABLE_TOP} highest KL; use --json for all)"
    has_region = any("region" in r for r in shown)
    hdr = f"{'pos':>6} {'token':>8} {'ref_top1':>8} {'cand_top1':>9} {'flip':>4} " \
          f"{'kl':>11} {'delta_p':>11} {'margin':>9} {'rank':>7} {'entropy':>8}"
    has_class = any("flip_class" in r for r in shown)
    if has_class:
        hdr += f" {'class':>8}"
    if has_region:
        hdr += "  region"
    lines.append(hdr)
    for r in shown:
        line = (f"{r['position']:>6} {_f(r['token'], 'd'):>8} {r['ref_top1']:>8} "
                f"{r['cand_top1']:>9} {'FLIP' if r['flip'] else '':>4} "
                f"{_f(r['kl'], '.4e'):>11} {_f(r['delta_p'], '+.3e'):>11} "
                f"{_f(r['margin'], '.5f'):>9} {str(r['rank']):>7} {_f(r['entropy'], '.4f'):>8}")
        if has_class:
            line += f" {r.get('flip_class') or '':>8}"
        if has_region:
            line += f"  {r.get('region', '')}"
        lines.append(line)
    if note:
        lines.append(note)
    lines.append("")

    kl = s["kl"]
    lines.append("====== KL divergence statistics ======")
    lines.append(f"Mean    KLD: {_pm(kl['mean'], kl['se'], '10.6f')}")
    lines.append(f"Maximum KLD: {_f(kl['max'], '10.6f')}")
    for p in PERCENTILES:
        lines.append(f"{_pct_label(p)} KLD: {_f(kl['p%g' % p], '10.6f')}")
    lines.append(f"Minimum KLD: {_f(kl['min'], '10.6f')}")
    lines.append("")
    dp = s["delta_p"]
    lines.append("====== Token probability statistics ======")
    lines.append(f"Mean    Δp: {_pm(dp['mean'], dp['se'], '8.3f', 100)} %")
    lines.append(f"Maximum Δp: {_f(None if dp['max'] is None else 100 * dp['max'], '8.3f')} %")
    for p in PERCENTILES:
        v = dp["p%g" % p]
        lines.append(f"{_pct_label(p)} Δp: {_f(None if v is None else 100 * v, '8.3f')} %")
    lines.append(f"Minimum Δp: {_f(None if dp['min'] is None else 100 * dp['min'], '8.3f')} %")
    lines.append(f"RMS Δp    : {_pm(dp['rms'], dp['rms_se'], '8.3f', 100)} %")
    st = s["same_top_p"]
    lines.append(f"Same top p: {_pm(st['p'], st['se'], '8.3f', 100)} %")
    lines.append("")
    first = s["first_flip"]
    lines.append(f"Flips (argmax differs): {s['flips']} of {s['n']}"
                 + (f", first at position {first}" if first is not None else ""))
    if "flips_by_class" in s:
        lines.append("Flips by class: " + ", ".join(f"{k} {v}" for k, v in s["flips_by_class"].items()))
    if "flips_by_region" in s:
        parts = [f"{k} {v}/{s['positions_by_region'][k]}" for k, v in s["flips_by_region"].items()]
        lines.append("Flips by region: " + ", ".join(parts))
    if s.get("approximate"):
        lines.append("NOTE: approximate metrics from top-k logprobs; KL is a lower bound.")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- loaders (I/O)


def load_logits(path: str | os.PathLike[str], name: str = "logits") -> np.ndarray:
    """A .npy logits matrix, memory-mapped (no pickles)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise AnalysisInputError(f"{name}: file not found: {p}", "file")
    if os.path.isdir(p):
        raise AnalysisInputError(f"{name}: {p} is a directory, expected a .npy file", "file")
    try:
        a = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise AnalysisInputError(f"{name}: cannot read {p} as a .npy array ({exc})", "file") from None
    if not isinstance(a, np.ndarray):
        try:
            a.close()
        except Exception:  # pragma: no cover - best effort  # noqa: BLE001
            pass
        raise AnalysisInputError(f"{name}: {p} is an .npz archive, expected a single .npy array", "file")
    return a


def load_tokens(path: str | os.PathLike[str]) -> tuple[list[Any], list[str] | None]:
    """Reference token ids from JSON: a list of ints, or ``{"tokens": [...],
    "regions": [...]}`` (regions optional, one label per position)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise AnalysisInputError(f"tokens: file not found: {p}", "file")
    try:
        with open(p, "rb") as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AnalysisInputError(f"tokens: cannot read {p} as JSON ({exc})", "file") from None
    regions = None
    if isinstance(data, dict):
        if "tokens" not in data:
            raise AnalysisInputError(f"tokens: {p} is a JSON object without a 'tokens' list", "format")
        regions = data.get("regions")
        data = data["tokens"]
        if regions is not None and not (isinstance(regions, list)
                                        and all(isinstance(r, str) for r in regions)):
            raise AnalysisInputError("tokens: 'regions' must be a list of strings", "format")
    if not isinstance(data, list):
        raise AnalysisInputError(f"tokens: {p} must hold a JSON list of token ids", "format")
    for i, v in enumerate(data):
        if isinstance(v, bool) or not isinstance(v, int):
            raise AnalysisInputError(f"tokens: entry {i} is not an integer token id: {v!r}", "dtype")
    return data, regions


def _dumps(obj: Any) -> str:
    try:
        import orjson

        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY).decode()
    except ImportError:  # pragma: no cover - orjson is a dependency
        def clean(o: Any) -> Any:
            if isinstance(o, float) and not math.isfinite(o):
                return None
            if isinstance(o, dict):
                return {k: clean(v) for k, v in o.items()}
            if isinstance(o, list):
                return [clean(v) for v in o]
            return o

        return json.dumps(clean(obj), allow_nan=False)


def run_analyze(ref_path: str, cand_path: str, tokens_path: str, as_json: bool = False,
                noise_path: str | None = None, rule: TieRule = DEFAULT_RULE) -> int:
    """CLI entry: 0 on success, 2 (message on stderr) for unusable inputs."""
    try:
        ref = load_logits(ref_path, "ref")
        cand = load_logits(cand_path, "cand")
        noise = load_logits(noise_path, "noise") if noise_path is not None else None
        tokens, regions = load_tokens(tokens_path)
        result = analyze(ref, cand, tokens, regions, noise=noise, rule=rule)
    except AnalysisInputError as exc:
        print(f"tensorverse analyze: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print("tensorverse analyze: error: out of memory", file=sys.stderr)
        return 2
    try:
        if as_json:
            sys.stdout.write(_dumps(result) + "\n")
        else:
            sys.stdout.write(render_table(result))
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. piped into `head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
    return 0
