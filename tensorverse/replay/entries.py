"""One turn's forced and free entries in replay's case format, from rows and runs already in
hand: pure functions over :mod:`tensorverse.analysis`. The matrix (a point against the reference
point, :mod:`tensorverse.matrix.compare`), bisection, ``rig run`` and batch-noise runs build their
cases with them, so :func:`tensorverse.replay.report.summarize_backend` summarizes every one of
them exactly as it summarizes a replay.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["forced_turn", "free_turn"]


def forced_turn(ref: np.ndarray, cand: np.ndarray, tokens: list[int]) -> dict[str, Any]:
    """Forced metrics of one turn in replay's case format, plus the margin and tokens of the
    first flip (what bisection reports) and the class of every flip (tie and near_tie on the
    reference configuration's rows; no noise run here, so no flip is ``noise``)."""
    from tensorverse.analysis.attribution import classify_forced
    from tensorverse.analysis.flips import forced_flips
    from tensorverse.analysis.metrics import position_metrics

    m = position_metrics(ref, cand, tokens)
    flips = forced_flips(m)
    classes = classify_forced(ref, m.ref_top1, m.cand_top1)
    out: dict[str, Any] = {"kind": "full", "n": len(tokens), "flips": flips,
                           "first_flip": flips[0] if flips else None, "approximate": False,
                           "top1_agree": int(np.asarray(m.top1_agree, bool).sum()),
                           "kl": [round(float(x), 9) for x in m.kl],
                           "flip_regions": [None] * len(flips),
                           "flip_classes": [a.flip_class.value for a in classes]}
    if flips:
        p = flips[0]
        out["first_flip_detail"] = {"position": p, "margin": float(m.margin[p]) + 0.0,  # no -0.0
                                    "ref_top1": int(m.ref_top1[p]), "cand_top1": int(m.cand_top1[p]),
                                    "token": int(tokens[p]), "kl": float(m.kl[p]),
                                    "flip_class": classes[0].flip_class.value}
    return out


def free_turn(ref_tokens: list[int], ref_text: str, run: Mapping[str, Any] | None, vs: str) -> dict[str, Any] | None:
    """A free run against ``ref_tokens``/``ref_text``: divergence and the tool-call verdict."""
    from tensorverse.analysis.flips import free_divergence
    from tensorverse.analysis.toolcalls import compare_tool_calls

    if not run:
        return None
    res: dict[str, Any] = {"status": run.get("status"), "capture": run.get("capture"),
                           "method": run.get("method"), "template": None, "vs": vs}
    if run.get("status") != "ok":
        res["error"] = run.get("error")
        return res
    d = free_divergence(ref_tokens, run.get("token_ids") or [])
    v = compare_tool_calls(ref_text or "", run.get("text") or "")
    res.update(tokens=len(run.get("token_ids") or []), finish_reason=run.get("finish_reason"),
               diverged=d.diverged, first_flip=d.position, common_prefix=d.common_prefix,
               verdict=v.verdict, differences=[{"kind": x.kind, "path": x.path} for x in v.differences])
    return res
