"""A rig run's per-position rows (bundle format 1, :mod:`tensorverse.bundle.format`) from one
turn's forced rows: a pure function.

Every setting forces the corpus's recorded tokens, so position ``i`` of a turn is the same token
on every rig. For each position: the setting's own top-1 (ties to the lower id, as argmax), the
flip (top-1 is not the recorded token), the margin (the recorded token's logit minus the best
other logit, float64: negative exactly where a flip is not a tie), the KL from the rig's reference
setting (:func:`tensorverse.analysis.metrics.position_metrics`, full vocabulary, float64), the
flip's class (:func:`tensorverse.analysis.attribution.margin_class` on the setting's own row:
``tie`` / ``near_tie`` on its dtype's grid; else ``noise`` where the rig's same-config noise point
flips too; else ``runtime``), and at flips the top :data:`~tensorverse.bundle.format.TOPK_AT_FLIPS`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tensorverse.analysis.attribution import margin_class, row_dtype
from tensorverse.analysis.metrics import position_metrics, widen_bf16
from tensorverse.bundle.format import TOPK_AT_FLIPS

__all__ = ["turn_positions", "flips_of"]


def flips_of(rows: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """Per position, whether the row's argmax is not the recorded token."""
    return np.asarray(rows).argmax(axis=1) != np.asarray(tokens, dtype=np.int64)


def turn_positions(setting: str, case: str, turn: int, tokens: Sequence[int], rows: np.ndarray,
                   ref_rows: np.ndarray | None, *, noise_flips: np.ndarray | None = None) -> list[dict[str, Any]]:
    """The position rows of one setting's forced run of one turn. ``rows``/``ref_rows``:
    positions x vocabulary (float16/32/64 or uint16 bfloat16 patterns); ``ref_rows`` None: this
    is the reference setting (KL 0). ``noise_flips``: per position, whether the noise point flips."""
    raw = np.asarray(rows)
    t = np.asarray(tokens, dtype=np.int64)
    n = t.shape[0]
    if raw.ndim != 2 or raw.shape[0] != n:
        raise ValueError(f"{setting} {case} turn {turn}: {raw.shape} rows for {n} tokens")
    w = widen_bf16(raw).astype(np.float64)
    kl = np.zeros(n) if ref_rows is None else position_metrics(ref_rows, w, t).kl
    out: list[dict[str, Any]] = []
    for i in range(n):
        row = w[i]
        tok = int(t[i])
        top1 = int(row.argmax())
        other = row.copy()
        other[tok] = -np.inf
        margin = float(row[tok] - other.max()) + 0.0  # no -0.0
        flip = top1 != tok
        rec: dict[str, Any] = {"setting": setting, "case": case, "turn": int(turn), "position": i, "token": tok,
                               "top1": top1, "flip": flip, "flip_class": None, "margin": margin,
                               "kl": max(float(kl[i]), 0.0) if ref_rows is not None else 0.0,
                               "topk_ids": None, "topk_logits": None}
        if flip:
            cls, _, _ = margin_class(row[top1], row[tok], row_dtype(raw[i]))
            rec["flip_class"] = (cls.value if cls is not None else
                                 "noise" if noise_flips is not None and bool(noise_flips[i]) else "runtime")
            order = np.lexsort((np.arange(row.shape[0]), -row))[:TOPK_AT_FLIPS]  # by logit, ties to the lower id
            rec["topk_ids"] = [int(j) for j in order]
            rec["topk_logits"] = [float(np.float32(row[j])) for j in order]
        out.append(rec)
    return out
