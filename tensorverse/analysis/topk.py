"""Approximate metrics from top-k logprobs only (backends without full-logits capture).

An OpenAI-compatible server returns, per position, the logprobs of its k most likely tokens
(plus the sampled one). With ``return_tokens_as_token_ids`` vLLM keys them ``"token_id:N"``.
From two such lists (reference P, candidate Q) and the reference token ``t``:

- Both distributions are *coarsened* to the same partition: one bucket per token known on
  **both** sides, plus one tail bucket holding everything else (``1 - known mass`` on each
  side). A token in one side's top-k but missing from the other's therefore falls into the
  tail on both sides. ``kl`` is KL(P||Q) over that partition: by the data-processing
  inequality it is a **lower bound** of the full-vocabulary KL (given exact logprobs).
- ``top1_agree``: the most likely known token of each side (exact whenever k >= 1).
- ``delta_p`` = q(t) - p(t) when t is known on both sides, else NaN (unknown).
- ``rank`` of t under Q: the number of Q's known tokens strictly above q(t) (exact when t is
  in Q's top-k); when t is missing from Q's list it is only known that rank >= k (k = the
  number of tokens Q reported) and ``rank_lower_bound`` is set ( rows show ``">= k"``).
- ``margin`` from P's two best known tokens (NaN when P reported only one).
- ``entropy``: known terms plus the tail as one bucket: a lower bound.

Results carry ``approximate=True``; :func:`tensorverse.analysis.metrics.summarize` passes the
flag into the summary. No I/O happens in this module.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from tensorverse.analysis.metrics import AnalysisInputError, PositionMetrics

__all__ = [
    "TAIL_FLOOR",
    "parse_top_logprobs",
    "topk_logprobs",
    "topk_position_metrics",
]

#: Tail masses below this are clamped to it: API logprobs are float32-rounded, so a tail
#: computed as 1 - sum(known) is noise at this level and may even come out negative.
TAIL_FLOOR = 1e-12

# vLLM serialises -inf logprobs as -9999.0.
_NEG_INF_SENTINEL = -9999.0


def _token_id(key: Any) -> int:
    if isinstance(key, (bool, np.bool_)):
        raise AnalysisInputError(f"top-k logprobs: bad token key {key!r}", "format")
    if isinstance(key, (int, np.integer)):
        return int(key)
    if isinstance(key, str):
        s = key[len("token_id:"):] if key.startswith("token_id:") else key
        try:
            return int(s)
        except ValueError:
            pass
    raise AnalysisInputError(
        f"top-k logprobs: key {key!r} is not a token id; request the logprobs with "
        "return_tokens_as_token_ids so keys read 'token_id:N'", "format"
    )


def _logprob(v: Any, key: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise AnalysisInputError(f"top-k logprobs: logprob of {key!r} is not a number: {v!r}", "format") from None
    if math.isnan(f) or f > 1e-6:
        raise AnalysisInputError(f"top-k logprobs: logprob of {key!r} is invalid: {v!r}", "value")
    if f <= _NEG_INF_SENTINEL:
        return -math.inf
    return min(f, 0.0)


def _stored_pairs(entry: list[Any]) -> dict[int, float] | None:
    """The stored form (``[[id, logprob], ...]``: ints and finite logprobs in (-9999, 0]) read
    without the general path's checks, which cost more than the reading (the comparisons read
    every position of every run); ``None`` as soon as one item is not of that form, so the
    general path reads (or refuses) the entry as it always did."""
    out: dict[int, float] = {}
    for it in entry:
        if type(it) is not list or len(it) != 2:
            return None
        k, v = it
        if type(k) is not int or type(v) is not float or not _NEG_INF_SENTINEL < v <= 0.0:
            return None
        out[k] = v
    return out


def parse_top_logprobs(entry: Any) -> dict[int, float]:
    """One position's top-k logprobs as ``{token_id: logprob}``.

    Accepts a mapping (completions API: ``{"token_id:42": -0.1, ...}``, or int keys), a list
    of ``{"token": ..., "logprob": ...}`` (chat API ``top_logprobs``), a chat API content item
    (``{"token", "logprob", "top_logprobs"}``: the sampled token is merged in), or a list of
    ``(token_id, logprob)`` pairs."""
    if type(entry) is list:
        fast = _stored_pairs(entry)
        if fast is not None:
            return fast
    return _general_top_logprobs(entry)


def _general_top_logprobs(entry: Any) -> dict[int, float]:
    """:func:`parse_top_logprobs` for every form it accepts, each item checked."""
    if entry is None:
        raise AnalysisInputError("top-k logprobs: missing entry (None) for a position", "format")
    out: dict[int, float] = {}
    items: Iterable[tuple[Any, Any]]
    if isinstance(entry, Mapping):
        if "top_logprobs" in entry:
            out.update(parse_top_logprobs(entry["top_logprobs"] or []))
            if "token" in entry and "logprob" in entry:
                out.setdefault(_token_id(entry["token"]), _logprob(entry["logprob"], entry["token"]))
            return out
        items = entry.items()
    elif isinstance(entry, (list, tuple)):
        pairs = []
        for it in entry:
            if isinstance(it, Mapping):
                if "token" not in it or "logprob" not in it:
                    raise AnalysisInputError(f"top-k logprobs: item without token/logprob: {it!r}", "format")
                pairs.append((it["token"], it["logprob"]))
            elif isinstance(it, (list, tuple)) and len(it) == 2:
                pairs.append((it[0], it[1]))
            else:
                raise AnalysisInputError(f"top-k logprobs: cannot read item {it!r}", "format")
        items = pairs
    else:
        raise AnalysisInputError(f"top-k logprobs: cannot read entry of type {type(entry).__name__}", "format")
    for k, v in items:
        out[_token_id(k)] = _logprob(v, k)
    return out


def topk_logprobs(logits: np.ndarray, k: int) -> list[dict[int, float]]:
    """The top-k logprobs of every row of a full logits matrix, as an API would report them
    (float64 log-softmax; ties broken by lower token id). For tests and simulations."""
    a = np.asarray(logits, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    k = int(min(k, a.shape[1]))
    out = []
    for row in a:
        m = row.max()
        lse = m + math.log(float(np.exp(row - m).sum()))
        idx = np.lexsort((np.arange(row.size), -row))[:k]
        out.append({int(i): float(row[i] - lse) for i in idx})
    return out


def _tail(lps: Sequence[float]) -> float:
    """1 - sum(exp(lps)) computed without cancellation when the known mass is close to 1.
    Plain floats, not numpy: a position has a few dozen entries, where numpy's per-call cost
    would dominate (this runs once per compared position)."""
    if not lps:
        return 1.0
    m = max(lps)
    if m == -math.inf:
        return 1.0
    lse = m + math.log(math.fsum([math.exp(x - m) for x in lps]))
    return -math.expm1(lse) if lse < 0 else 0.0


def _top_two(d: dict[int, float]) -> tuple[int, float, float | None]:
    # most likely first; ties -> lowest token id
    best = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))
    return best[0][0], best[0][1], (best[1][1] if len(best) > 1 else None)


def topk_position_metrics(
    ref_topk: Sequence[Any],
    cand_topk: Sequence[Any],
    tokens: Sequence[int] | np.ndarray,
    *,
    k: int | None = None,
    tail_floor: float = TAIL_FLOOR,
) -> PositionMetrics:
    """Approximate per-position metrics from top-k logprobs (see the module docstring).

    ``ref_topk``/``cand_topk``: one entry per position (any form :func:`parse_top_logprobs`
    reads). ``k``: the top_logprobs count that was requested, if known; then a token present
    only as the extra sampled entry (rank >= k) is also flagged as a lower bound."""
    n = len(tokens)
    if n == 0:
        raise AnalysisInputError("top-k metrics: no positions", "empty")
    if len(ref_topk) != n or len(cand_topk) != n:
        raise AnalysisInputError(
            f"top-k metrics: {len(ref_topk)} reference and {len(cand_topk)} candidate entries "
            f"for {n} tokens (one entry per position expected)", "shape"
        )
    try:
        t = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise AnalysisInputError(f"tokens: not a list of token ids ({exc})", "format") from None
    if t.ndim != 1 or t.dtype.kind not in "iu":
        raise AnalysisInputError(f"tokens: expected a flat list of integer token ids, got {t.dtype}", "dtype")
    if (t < 0).any():
        raise AnalysisInputError("tokens: negative token id", "token_id")

    kl = np.empty(n)
    delta_p = np.empty(n)
    margin = np.empty(n)
    entropy = np.empty(n)
    rank = np.empty(n, np.int64)
    lower = np.zeros(n, bool)
    r1 = np.empty(n, np.int64)
    c1 = np.empty(n, np.int64)

    for i in range(n):
        P = parse_top_logprobs(ref_topk[i])
        Q = parse_top_logprobs(cand_topk[i])
        if not P or not Q:
            side = "reference" if not P else "candidate"
            raise AnalysisInputError(f"top-k metrics: empty {side} top-k at position {i}", "empty")
        ti = int(t[i])

        # KL over {tokens known on both sides} + one tail bucket
        both = sorted(P.keys() & Q.keys())
        lp = [P[j] for j in both]
        lq = [Q[j] for j in both]
        pt = max(_tail(lp), tail_floor)
        qt = max(_tail(lq), tail_floor)
        terms = []
        for a, b in zip(lp, lq):
            pa_ = math.exp(a)
            if pa_ > 0:
                terms.append(pa_ * (a - b))
        k_sum = math.fsum(terms) + pt * (math.log(pt) - math.log(qt))
        kl[i] = max(k_sum, 0.0)

        a1, v1, v2 = _top_two(P)
        b1, _, _ = _top_two(Q)
        r1[i] = a1
        c1[i] = b1
        margin[i] = math.exp(v1) - math.exp(v2) if v2 is not None else math.nan

        if ti in P and ti in Q:
            delta_p[i] = math.exp(Q[ti]) - math.exp(P[ti])
        else:
            delta_p[i] = math.nan

        if ti in Q:
            qv = Q[ti]
            rank[i] = sum(1 for v in Q.values() if v > qv)
            if k is not None and rank[i] >= k:
                lower[i] = True
        else:
            rank[i] = len(Q) if k is None else max(int(k), 0)
            lower[i] = True

        lpa = list(P.values())
        ptail = _tail(lpa)
        h = -math.fsum([math.exp(x) * x for x in lpa if math.exp(x) > 0])
        if ptail > tail_floor:
            h -= ptail * math.log(ptail)
        entropy[i] = max(h, 0.0)

    return PositionMetrics(
        top1_agree=r1 == c1,
        kl=kl,
        delta_p=delta_p,
        margin=margin,
        rank=rank,
        entropy=entropy,
        ref_top1=r1,
        cand_top1=c1,
        tokens=t.astype(np.int64),
        approximate=True,
        rank_lower_bound=lower,
    )
