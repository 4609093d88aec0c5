"""``tensorverse bisect``: which of the settings that differ between a good and a bad point makes
one case flip. The oracle of a set of changes is a forced run of that case on the good point's
configuration with those changes applied: it reproduces the flip when its top-1 at the flip
position (the first forced flip of bad against good) is not good's top-1 there. Runs share the
matrix's cache (``OUT/runs/<key>``), so points a matrix already captured cost nothing, and each
configuration replays only the one case.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from tensorverse.matrix.bisect import CachedOracle, ddmin
from tensorverse.matrix.executor import Executor
from tensorverse.matrix.grid import Progress, ensure_runs
from tensorverse.matrix.outlock import output_lock
from tensorverse.matrix.spec import MatrixSpec, Point, point_label

__all__ = ["run_bisect", "BisectError", "render_bisect", "differing"]


class BisectError(ValueError):
    """Nothing to bisect (no flip on the case, a point that cannot run, no differing setting)."""


def differing(good: dict[str, Any], bad: dict[str, Any], order: list[str] | None = None) -> list[str]:
    """Settings whose effective value differs, in ``order`` (the bad point's own settings as the
    spec lists them) and then sorted."""
    keys = list(dict.fromkeys([*(order or []), *sorted(bad), *sorted(good)]))
    return [k for k in keys if json.dumps(good.get(k), sort_keys=True) != json.dumps(bad.get(k), sort_keys=True)]


def _top1_at(out: Path, key: str, case: str, turn: int, p: int) -> int | None:
    from tensorverse.matrix.compare import TurnRows

    with TurnRows(out, key) as r:
        rows = r.forced_rows(case, turn)
    return None if rows is None or rows.shape[0] <= p else int(np.argmax(rows[p]))


def _run_keys(out: Path) -> set[str]:
    return {p.parent.name for p in (out / "runs").glob("*/run.json")}


def run_bisect(spec: MatrixSpec, corpus_path: str, out: str | Path, good: str, bad: str, case: str, *,
               progress: bool = True, stream: Any = None, executor: Executor | None = None) -> dict[str, Any]:
    """Bisect (each configuration run by ``executor``; default: here); writes
    ``OUT/bisect-<case>.json`` and returns it. Holds ``OUT/.lock`` while it runs."""
    with output_lock(out):
        return _bisect(spec, corpus_path, Path(out), good, bad, case, progress=progress, stream=stream,
                       executor=executor)


def _bisect(spec: MatrixSpec, corpus_path: str, out: Path, good: str, bad: str, case: str, *,
            progress: bool, stream: Any, executor: Executor | None) -> dict[str, Any]:
    from tensorverse.matrix.compare import TurnRows
    from tensorverse.replay.entries import forced_turn, free_turn
    from tensorverse.replay.corpus import load_corpus

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    before = _run_keys(out)
    corpus = load_corpus(corpus_path)
    by_id = {c["id"]: c for c in corpus.cases}
    if case not in by_id:
        raise BisectError(f"--case {case!r} is not in the corpus ({len(by_id)} cases)")
    gp, bp = spec.point(good), spec.point(bad)
    geff, beff = spec.effective(gp.settings), spec.effective(bp.settings)
    diffs = differing(geff, beff, list(bp.settings))
    if not diffs:
        raise BisectError(f"{good!r} and {bad!r} have the same effective settings")
    prog = Progress(None, enabled=progress, stream=stream)
    prog.log(f"bisect {case} between {good!r} and {bad!r}: {len(diffs)} differing setting(s): {', '.join(diffs)}")

    def run_of(p: Point) -> dict[str, Any]:
        # the good point is the reference: its free output is the basis every run decodes
        return ensure_runs(spec, corpus_path, out, [gp, p], gp, cases=[case], progress=prog,
                           executor=executor)[p.name]

    grun, brun = run_of(gp), run_of(bp)
    for name, run in ((good, grun), (bad, brun)):
        if run.get("status") != "ok":
            raise BisectError(f"point {name!r} did not run: {run.get('status')}: {run.get('error')}")
    flip = None
    with TurnRows(out, grun["key"]) as G, TurnRows(out, brun["key"]) as B:
        for turn in by_id[case]["turns"]:
            i = turn["index"]
            g, b = G.forced_rows(case, i), B.forced_rows(case, i)
            tokens = (G.entry(case, i, "forced") or {}).get("tokens") or []
            if g is None or b is None:
                continue
            f = forced_turn(g, b, list(tokens))
            if f["first_flip"] is not None:
                ge, be = G.entry(case, i, "free") or {}, B.entry(case, i, "free") or {}
                rec = turn.get("reference") or {}
                flip = {"turn": i, **f["first_flip_detail"], "n": f["n"], "flips": len(f["flips"]),
                        "vs_good": free_turn(ge.get("token_ids") or tokens, ge.get("text") or "", be, "basis")
                        if ge.get("status") == "ok" else None,
                        "vs_recorded": free_turn(rec.get("output_token_ids") or [], rec.get("text") or "", be, "recorded")}
                break
    if flip is None:
        raise BisectError(f"case {case!r}: {bad!r} has no forced flip against {good!r}: nothing to bisect")
    turn_i, p, good_top1 = flip["turn"], flip["position"], flip["ref_top1"]

    def settings_for(changes: frozenset) -> dict[str, Any]:
        s = dict(gp.settings)
        for k in diffs:
            if k in changes:
                s[k] = beff.get(k)  # None: the setting is absent on the bad point
        return s

    def oracle(changes: frozenset) -> bool | None:
        ordered = [k for k in diffs if k in changes]
        name = "bisect:" + point_label({k: beff.get(k) for k in ordered})
        run = run_of(Point(name=name, settings=settings_for(changes)))
        if run.get("status") != "ok":
            prog.log(f"{name}: {run.get('status')} (counted as not reproducing)")
            return None
        top1 = _top1_at(out, run["key"], case, turn_i, p)
        verdict = None if top1 is None else top1 != good_top1
        prog.log(f"test {{{', '.join(ordered)}}}: "
                 f"{'flips' if verdict else 'no flip' if verdict is False else 'no rows'}"
                 f" (top-1 {top1} vs good {good_top1} at turn {turn_i} position {p})")
        return verdict

    cached = CachedOracle(oracle)
    res = ddmin(diffs, cached)
    keep = ("verdict", "diverged", "first_flip", "differences")
    report = {
        "format": "tensorverse.bisect", "format_version": 1, "case": case, "good": good, "bad": bad,
        "differing": {k: {"good": geff.get(k), "bad": beff.get(k)} for k in diffs},
        "minimal": {k: {"good": geff.get(k), "bad": beff.get(k)} for k in res.minimal},
        "flip": {"turn": turn_i, "position": p, "margin": flip["margin"], "good_top1": good_top1,
                 "bad_top1": flip["cand_top1"], "basis_token": flip["token"], "kl": flip["kl"],
                 "forced_flips_in_turn": flip["flips"], "positions": flip["n"]},
        "toolcall": {"vs_good": {k: (flip["vs_good"] or {}).get(k) for k in keep} if flip["vs_good"] else None,
                     "vs_recorded": {k: (flip["vs_recorded"] or {}).get(k) for k in keep} if flip["vs_recorded"] else None},
        "tests": [{"changes": [k for k in diffs if k in s], "reproduces": v} for s, v in res.history],
        "oracle_calls": res.oracle_calls,
        "servers_started": len(_run_keys(out) - before),
        "configurations": len(res.history) + 2,
        "grid_size": 2 ** len(diffs),
        "unresolved": [[k for k in diffs if k in s] for s in cached.unresolved],
        "wall_s": round(time.monotonic() - t0, 3),
    }
    (out / f"bisect-{case}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


def render_bisect(r: dict[str, Any]) -> str:
    f = r["flip"]
    lines = [f"bisect of case {r['case']}: {r['good']} (good) vs {r['bad']} (bad), "
             f"{len(r['differing'])} differing setting(s)",
             f"flip at turn {f['turn']} position {f['position']}: good top-1 {f['good_top1']}, bad top-1 "
             f"{f['bad_top1']} (margin {abs(f['margin']):.4g}{': an exact tie' if f['margin'] == 0 else ''}, "
             f"KL {f['kl']:.3g})",
             "minimal setting set reproducing the flip:"]
    for k, v in r["minimal"].items():
        lines.append(f"  {k}: {v['good']!r} -> {v['bad']!r}")
    vg = (r.get("toolcall") or {}).get("vs_good") or {}
    if vg:
        lines.append(f"tool-call consequence (bad's free run vs good's): {vg.get('verdict')}, "
                     f"free divergence at {vg.get('first_flip')}")
    lines.append(f"{r['configurations']} configuration(s) tested ({r['servers_started']} server start(s)); "
                 f"the full grid over these settings has {r['grid_size']}; {r['wall_s']:.0f} s")
    return "\n".join(lines)
