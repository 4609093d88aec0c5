"""Per-position divergence metrics between a reference and a candidate logits matrix.

Rows are positions, columns the vocabulary. For position ``i`` with reference logits ``x``
(distribution P) and candidate logits ``y`` (distribution Q), both turned into log-softmax in
float64, and the reference token ``t`` (the token the primary emitted):

``top1_agree``  argmax P == argmax Q
``flip``        (forced mode) argmax Q != argmax P, i.e. ``not top1_agree``
``kl``          KL(P||Q) = sum p (log p - log q) over the whole vocabulary
``delta_p``     q(t) - p(t)
``margin``      p(top1) - p(top2) under P (0 when the top two tie)
``rank``        rank of t under Q: the number of entries of Q *strictly* greater than q(t)
                (0 = top; ties share the better rank, so a token tied for first has rank 0)
``entropy``     -sum p log p under P

Ties and argmax: softmax is strictly monotone, so argmax and ranks are taken on the logits
themselves (exact in every input dtype; float64 log-probabilities can round two distinct logits
to the same value). Among tied maxima the lowest token id is the top-1 (numpy's ``argmax``).

How it is fast. The straightforward float64 computation (log-softmax of both rows, then
``sum(p * (lp - lq))``) makes about a dozen full-vocabulary passes per position and allocates
full-width temporaries; on this project's machines each fresh ~1 MB allocation page-faults,
which costs more than the arithmetic (about 200 positions/s at a 151,936 vocabulary). Here:

- the algebra needs one float64 ``exp`` per entry of each row and four sums::

      zx = x - sx,  ex = exp(zx),  SP = sum ex,  A = sum ex*zx,  C = sum ex*zy
      zy = y - sy,  ey = exp(zy),  SQ = sum ey
      kl      = (A - C) / SP - log SP + log SQ        (= sum p (lp - lq))
      entropy = log SP - A / SP                       (= -sum p lp)

  where the shift ``s`` is 0 when a row's max logit lies within +-64 (exp can neither
  overflow nor lose the top of the distribution) and the row max otherwise (huge logits:
  such rows are found after the first pass and redone shifted);
- rows go through in blocks of 8 and the vocabulary in chunks of 4,096 entries, so every
  ufunc works on a tile in preallocated, L2-resident buffers (``out=``, no allocation), the
  inputs are read from memory once (the per-tile maxima that give argmax, second max and
  the shift come from the same tile), and Python overhead is paid per tile, not per row;
- per tile, ``EZ @ [1; zx; zy]^T`` (one small BLAS gemm) yields SP, A, C and SQ at once;
- argmax / second max / rank are exact comparisons on the input dtype (no float64 needed).

One path serves every input: bf16-exact float32 rows (vLLM's), plain float32, float16 and
float64. A lookup table over the 65,536 bf16 codes was measured and rejected: numpy's SIMD
float64 ``exp`` costs about 0.8 ns per entry here, while gathering from a table (or
``bincount`` over the codes) costs 1.5-2.5 ns per entry once the index conversion is counted.

Numerically the sums are over small, same-signed or shift-relative terms; against an
extended-precision reference the error is about 1e-13 (tested to 1e-9, including logits of
magnitude 1e4, float16 inputs, ties and one-hot rows). NaN/inf anywhere in a row make that
row's max or one of its sums non-finite; the row is then scanned and reported by index.
No I/O happens in this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from tensorverse.refusal import Refusal

__all__ = [
    "AnalysisInputError",
    "PositionMetrics",
    "position_metrics",
    "reference_position_metrics",
    "summarize",
    "validate_inputs",
    "widen_bf16",
    "PERCENTILES",
    "REGIONS",
]

#: Regions a position can lie in (README.md's vocabulary).
REGIONS: tuple[str, ...] = ("thinking", "content", "tool_name", "tool_args", "tool_syntax")

#: Percentiles of the KL report, in llama.cpp's order (max and min are reported separately).
PERCENTILES: tuple[float, ...] = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)

# Rows processed together, and vocabulary entries per chunk: every vectorised call works on a
# block x chunk tile; the float64 scratch tiles (5 x 8 x 4096 x 8 bytes = 1.3 MB) stay in L2,
# and Python overhead is paid once per tile rather than once per row.
_BLOCK = 8
_CHUNK = 4096
# Rows whose max logit lies within +-_NOSHIFT are exponentiated unshifted (see the kernel).
_NOSHIFT = 64.0


class AnalysisInputError(Refusal):
    """Inputs to an analysis function are unusable; ``reason`` says how, in one word:

    ``shape`` (arrays or lists that do not fit together: positions, rows, labels, dimensions),
    ``dtype`` (not floating logits, not integer token ids), ``non_finite`` (NaN or infinity in
    logits or in what is computed from them), ``token_id`` (a token id outside the vocabulary, or
    negative), ``vocabulary`` (two sides of different vocabularies), ``empty`` (no positions, no
    logits, too few to compare), ``missing`` (what a comparison needs was not captured or recorded),
    ``value`` (a parameter or count outside its range), ``file`` (a file that is absent or not of
    its kind), ``format`` (input that cannot be read as what it should be: top-k logprobs, token
    lists, region labels), ``compacted`` (a turn whose rows were compacted,
    `tensorverse.shadow.compare.TurnCompacted`)."""

    REASONS = ("shape", "dtype", "non_finite", "token_id", "vocabulary", "empty", "missing", "value", "file",
               "format", "compacted")


@dataclass(frozen=True, eq=False)
class PositionMetrics:
    """Per-position metrics; every array has length ``n`` (the number of positions).

    ``approximate`` is True when the metrics come from top-k logprobs only (see
    :mod:`tensorverse.analysis.topk`); then ``rank_lower_bound`` marks positions whose
    ``rank`` is only a lower bound (the token was not in the candidate's top-k: rank >= k).
    """

    top1_agree: np.ndarray  # bool
    kl: np.ndarray  # float64
    delta_p: np.ndarray  # float64
    margin: np.ndarray  # float64
    rank: np.ndarray  # int64
    entropy: np.ndarray  # float64
    ref_top1: np.ndarray  # int64
    cand_top1: np.ndarray  # int64
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64
    approximate: bool = False
    rank_lower_bound: np.ndarray | None = None  # bool, approximate metrics only

    @property
    def n(self) -> int:
        return int(self.kl.shape[0])

    def __len__(self) -> int:
        return self.n

    @property
    def flip(self) -> np.ndarray:
        """Forced-mode flips: argmax Q != argmax P."""
        return ~self.top1_agree

    def rows(self) -> list[dict[str, Any]]:
        """One dict per position with the DESIGN names plus position, token, ref_top1,
        cand_top1 and flip; plain Python scalars (JSON-ready; NaN stays a float NaN).
        Approximate metrics add ``approximate: True`` and give a lower-bound rank as ">= k"."""
        n = self.n
        tokens = self.tokens.tolist() if self.tokens.shape[0] == n else [None] * n
        agree = self.top1_agree.tolist()
        kl = self.kl.tolist()
        dp = self.delta_p.tolist()
        margin = self.margin.tolist()
        rank: list[Any] = self.rank.tolist()
        ent = self.entropy.tolist()
        r1 = self.ref_top1.tolist()
        c1 = self.cand_top1.tolist()
        if self.approximate and self.rank_lower_bound is not None:
            for i in np.flatnonzero(self.rank_lower_bound).tolist():
                rank[i] = f">= {rank[i]}"
        out = []
        for i in range(n):
            row = {
                "position": i,
                "token": tokens[i],
                "top1_agree": agree[i],
                "flip": not agree[i],
                "kl": kl[i],
                "delta_p": dp[i],
                "margin": margin[i],
                "rank": rank[i],
                "entropy": ent[i],
                "ref_top1": r1[i],
                "cand_top1": c1[i],
            }
            if self.approximate:
                row["approximate"] = True
            out.append(row)
        return out


# --------------------------------------------------------------------------- validation


def widen_bf16(a: np.ndarray) -> np.ndarray:
    """bfloat16 rows given as their ``uint16`` bit patterns (how the store's codec returns them:
    numpy has no bfloat16) as the float32 values they stand for, exactly; other arrays as they are."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a


def _as_matrix(a: Any, name: str) -> np.ndarray:
    if a is None:
        raise AnalysisInputError(f"{name}: no logits given", "empty")
    if not isinstance(a, np.ndarray):
        try:
            a = np.asarray(a)
        except (ValueError, TypeError) as exc:
            raise AnalysisInputError(f"{name}: not an array of logits ({exc})", "format") from None
    if a.dtype.kind != "f":
        raise AnalysisInputError(
            f"{name}: logits must be a floating dtype (float16/float32/float64), got {a.dtype}", "dtype"
        )
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if a.ndim != 2:
        raise AnalysisInputError(
            f"{name}: logits must be 2-D (positions x vocabulary), got shape {a.shape}", "shape"
        )
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise AnalysisInputError(f"{name}: empty logits matrix (shape {a.shape})", "empty")
    return a


def _as_tokens(tokens: Any, n: int, vocab: int) -> np.ndarray:
    if tokens is None:
        raise AnalysisInputError("tokens: no reference token ids given", "empty")
    try:
        t = np.asarray(tokens)
    except (ValueError, TypeError) as exc:
        raise AnalysisInputError(f"tokens: not a list of token ids ({exc})", "format") from None
    if t.ndim != 1:
        raise AnalysisInputError(f"tokens: expected a flat list of token ids, got shape {t.shape}", "shape")
    if t.dtype.kind not in "iu":
        if t.shape[0] == 0:
            t = t.astype(np.int64)
        else:
            raise AnalysisInputError(f"tokens: token ids must be integers, got {t.dtype}", "dtype")
    if t.shape[0] != n:
        raise AnalysisInputError(
            f"tokens: {t.shape[0]} token ids for {n} positions (one per logits row expected)", "shape"
        )
    bad = np.flatnonzero((t < 0) | (t >= vocab))
    if bad.size:
        i = int(bad[0])
        raise AnalysisInputError(
            f"tokens: token id {int(t[i])} at position {i} is outside the vocabulary "
            f"[0, {vocab}) ({bad.size} out of range)", "token_id"
        )
    return t.astype(np.int64, copy=False)


def _nonfinite_message(name: str, a: np.ndarray, row: int, offset: int = 0) -> str:
    r = np.asarray(a[row])
    nan = int(np.count_nonzero(np.isnan(r)))
    posinf = int(np.count_nonzero(np.isposinf(r)))
    neginf = int(np.count_nonzero(np.isneginf(r)))
    parts = [f"{c} {w}" for c, w in ((nan, "NaN"), (posinf, "+inf"), (neginf, "-inf")) if c]
    first = int(np.flatnonzero(~np.isfinite(r))[0]) if parts else -1
    return f"{name}: row {row + offset} contains non-finite logits ({', '.join(parts)}; first at column {first})"


def validate_inputs(ref: Any, cand: Any, tokens: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check shapes, dtypes and tokens (not finiteness: that is checked while computing).

    Returns ``(ref, cand, tokens)`` as 2-D float arrays and an int64 vector."""
    ref = _as_matrix(ref, "ref")
    cand = _as_matrix(cand, "cand")
    if ref.shape != cand.shape:
        raise AnalysisInputError(
            f"ref and cand shapes differ: {ref.shape} vs {cand.shape} "
            "(both must be positions x vocabulary)", "shape"
        )
    t = _as_tokens(tokens, ref.shape[0], ref.shape[1])
    return ref, cand, t


# --------------------------------------------------------------------------- the fast kernel


def position_metrics(
    ref: np.ndarray, cand: np.ndarray, tokens: Sequence[int] | np.ndarray
) -> PositionMetrics:
    """Metrics at every position of two logits matrices (positions x vocabulary).

    ``ref``/``cand`` may be float16, float32 or float64 (any mix); everything is computed in
    float64. Raises :class:`AnalysisInputError` for unusable inputs."""
    ref, cand, t = validate_inputs(ref, cand, tokens)
    n, vocab = ref.shape

    kl = np.empty(n)
    delta_p = np.empty(n)
    margin = np.empty(n)
    entropy = np.empty(n)
    rank = np.empty(n, np.int64)
    ref_top1 = np.empty(n, np.int64)
    cand_top1 = np.empty(n, np.int64)

    b = min(_BLOCK, n)
    w = min(_CHUNK, vocab)
    nch = -(-vocab // w)
    # Scratch for one block of rows x one vocabulary chunk (about 1.3 MB: stays in L2).
    # Z[:, 0] is all ones, Z[:, 1] holds zx and Z[:, 2] zy; EZ = exp(Z[:, 1:]). One small
    # gemm per tile, EZ @ Z^T, yields every sum at once:
    #   [[SP, A, C], [SQ, ., .]] with SP = sum ex, A = sum ex zx, C = sum ex zy, SQ = sum ey.
    scratch = _Scratch(
        Z=np.empty((b, 3, w)),
        EZ=np.empty((b, 2, w)),
        OUT=np.empty((nch, b, 2, 3)),
        TM=np.empty((nch, b, 2)),
        mask=np.empty(vocab, dtype=bool),
        w=w,
    )
    scratch.Z[:, 0, :] = 1.0

    with np.errstate(all="ignore"):
        for s in range(0, n, b):
            e = min(s + b, n)
            _block(ref[s:e], cand[s:e], t[s:e], s, scratch,
                   kl, entropy, delta_p, margin, rank, ref_top1, cand_top1)

    return PositionMetrics(
        top1_agree=ref_top1 == cand_top1,
        kl=kl,
        delta_p=delta_p,
        margin=margin,
        rank=rank,
        entropy=entropy,
        ref_top1=ref_top1,
        cand_top1=cand_top1,
        tokens=t.copy(),
    )


@dataclass
class _Scratch:
    Z: np.ndarray  # (b, 3, w): ones, zx, zy
    EZ: np.ndarray  # (b, 2, w): ex, ey
    OUT: np.ndarray  # (chunks, b, 2, 3): per-tile gemm results
    TM: np.ndarray  # (chunks, b, 2): per-tile max of x and y
    mask: np.ndarray  # (vocab,) bool
    w: int


def _sums(x: np.ndarray, y: np.ndarray, shift: np.ndarray | None, sc: _Scratch) -> np.ndarray:
    """Tile loop over the vocabulary for rows x, y (k x vocab, k <= block). Fills sc.TM with
    per-tile maxima and returns the (k, 2, 3) sums [[SP, A, C], [SQ, ., .]] of exp(row - shift)."""
    k, vocab = x.shape
    w = sc.w
    shift3 = None if shift is None or not shift.any() else shift[:, :, None]
    ci = 0
    for ci, o in enumerate(range(0, vocab, w)):
        wc = min(w, vocab - o)
        z = sc.Z[:k, :, :wc]
        zxy = z[:, 1:, :]
        ez = sc.EZ[:k, :, :wc]
        np.copyto(z[:, 1, :], x[:, o : o + wc])
        np.copyto(z[:, 2, :], y[:, o : o + wc])
        if shift3 is None:
            np.max(zxy, axis=2, out=sc.TM[ci, :k])
        else:
            np.subtract(zxy, shift3, out=zxy)
        np.exp(zxy, out=ez)
        np.matmul(ez, z.transpose(0, 2, 1), out=sc.OUT[ci, :k])
    return sc.OUT[: ci + 1, :k].sum(axis=0)


def _block(x, y, tt, s, sc: _Scratch, kl, entropy, delta_p, margin, rank,
           ref_top1, cand_top1) -> None:
    """Metrics for rows s..s+k of the run (x, y: k x vocab slices; tt: their tokens)."""
    k, vocab = x.shape
    w = sc.w
    e = s + k
    r = np.arange(k)

    # One pass over the inputs: sums of exp(unshifted rows) and per-tile maxima.
    tot = _sums(x, y, None, sc)
    nci = -(-vocab // w)
    tm = sc.TM[:nci, :k]  # (chunks, k, 2)
    best = np.argmax(tm, axis=0)  # first tile holding each row's max (NaN wins: argmax)
    mxy = tm[best, r[:, None], np.arange(2)[None, :]]  # (k, 2) row maxima, float64
    mx, my = mxy[:, 0], mxy[:, 1]
    # NaN and +inf show in the max; -inf shows up in the sums below (0 * -inf).
    _check_finite(mx, x, "ref", s)
    _check_finite(my, y, "cand", s)

    # Rows whose max lies outside +-_NOSHIFT may have overflowed or lost the top of the
    # distribution unshifted: redo them shifted by their max (rare: huge logits).
    shift = np.where(np.abs(mxy) <= _NOSHIFT, 0.0, mxy)
    for j in np.flatnonzero(shift.any(axis=1)).tolist():
        tot[j] = _sums(x[j : j + 1], y[j : j + 1], shift[j : j + 1], sc)[0]

    sp, a, c = tot[:, 0, 0], tot[:, 0, 1], tot[:, 0, 2]
    sq = tot[:, 1, 0]
    if not (np.isfinite(a).all() and np.isfinite(c).all()):
        _check_finite(np.where(np.isfinite(a), 0.0, np.nan), x, "ref", s, scan=True)
        _check_finite(np.where(np.isfinite(c), 0.0, np.nan), y, "cand", s, scan=True)
        raise AnalysisInputError(f"rows {s}..{e - 1}: non-finite intermediate results", "non_finite")
    lsp = np.log(sp)
    lsq = np.log(sq)
    # lp = zx - log SP, lq = zy - log SQ  =>  KL = sum p (zx - zy) - log SP + log SQ
    #                                        H  = log SP - sum p zx
    kl[s:e] = np.maximum((a - c) / sp - lsp + lsq, 0.0)
    entropy[s:e] = np.maximum(lsp - a / sp, 0.0)
    xt = x[r, tt].astype(np.float64)
    yt = y[r, tt].astype(np.float64)
    delta_p[s:e] = np.exp(yt - shift[:, 1]) / sq - np.exp(xt - shift[:, 0]) / sp
    p1 = np.exp(mx - shift[:, 0]) / sp

    for j in range(k):
        # top-1 of each side: first index of the max inside the first tile that holds it
        o = int(best[j, 0]) * w
        seg = x[j, o : o + w]
        i = int(np.argmax(seg))
        ref_top1[s + j] = o + i
        # second max of P: best of the other tiles' maxima and the rest of this tile
        m2 = -math.inf
        if nci > 1:
            others = tm[:, j, 0].copy()
            others[best[j, 0]] = -math.inf
            m2 = float(others.max())
        if i > 0:
            m2 = max(m2, float(seg[:i].max()))
        if i + 1 < seg.shape[0]:
            m2 = max(m2, float(seg[i + 1 :].max()))
        # p2 = p1 exp(m2 - max); m2 - max is exact in float64.
        margin[s + j] = -math.expm1(m2 - mx[j]) * p1[j]

        o = int(best[j, 1]) * w
        cand_top1[s + j] = o + int(np.argmax(y[j, o : o + w]))
        # rank = entries strictly above q(t): none when t ties the max.
        if yt[j] == my[j]:
            rank[s + j] = 0
        else:
            yr = y[j]
            rank[s + j] = np.count_nonzero(np.greater(yr, yr[tt[j]], out=sc.mask))


def _check_finite(v: np.ndarray, rows: np.ndarray, name: str, offset: int,
                  scan: bool = False) -> None:
    bad = np.flatnonzero(~np.isfinite(v))
    for row in bad.tolist():
        if scan and np.isfinite(rows[row]).all():
            continue
        raise AnalysisInputError(_nonfinite_message(name, rows, row, offset), "non_finite")


def reference_position_metrics(
    ref: np.ndarray, cand: np.ndarray, tokens: Sequence[int] | np.ndarray
) -> PositionMetrics:
    """The straightforward per-position float64 evaluation (log-softmax of both rows, then
    the definitions literally). Slow; kept as the baseline the benchmark compares against."""
    ref, cand, t = validate_inputs(ref, cand, tokens)
    n, vocab = ref.shape
    out = {k: np.empty(n) for k in ("kl", "delta_p", "margin", "entropy")}
    rank = np.empty(n, np.int64)
    r1 = np.empty(n, np.int64)
    c1 = np.empty(n, np.int64)
    for i in range(n):
        x = np.asarray(ref[i], dtype=np.float64)
        y = np.asarray(cand[i], dtype=np.float64)
        if not (np.isfinite(x).all()):
            raise AnalysisInputError(_nonfinite_message("ref", ref, i), "non_finite")
        if not (np.isfinite(y).all()):
            raise AnalysisInputError(_nonfinite_message("cand", cand, i), "non_finite")
        lp = x - x.max()
        lp -= np.log(np.exp(lp).sum())
        lq = y - y.max()
        lq -= np.log(np.exp(lq).sum())
        p = np.exp(lp)
        q = np.exp(lq)
        out["kl"][i] = max(float(np.sum(p * (lp - lq))), 0.0)
        out["entropy"][i] = max(float(-np.sum(p * lp)), 0.0)
        out["delta_p"][i] = q[t[i]] - p[t[i]]
        i1 = int(np.argmax(x))
        r1[i] = i1
        c1[i] = int(np.argmax(y))
        rest = np.delete(p, i1)
        out["margin"][i] = p[i1] - (rest.max() if rest.size else 0.0)
        rank[i] = int(np.count_nonzero(y > y[t[i]]))
    return PositionMetrics(
        top1_agree=r1 == c1,
        kl=out["kl"],
        delta_p=out["delta_p"],
        margin=out["margin"],
        rank=rank,
        entropy=out["entropy"],
        ref_top1=r1,
        cand_top1=c1,
        tokens=t.copy(),
    )


# --------------------------------------------------------------------------- summaries


def _mean_se(v: np.ndarray) -> tuple[float, float | None]:
    """Mean and its standard error sqrt(var/(n-1)) with the population variance
    (llama.cpp's mean_and_uncertainty), i.e. sample std / sqrt(n); None for n < 2."""
    n = v.shape[0]
    mean = float(v.mean())
    if n < 2:
        return mean, None
    var = float(np.mean((v - mean) ** 2))
    return mean, math.sqrt(var / (n - 1))


def _distribution(v: np.ndarray) -> dict[str, float | None]:
    """mean ± se, max, the llama.cpp percentiles (linear interpolation), min; NaN ignored."""
    v = np.asarray(v, dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size == 0:
        out: dict[str, float | None] = {"n": 0, "mean": None, "se": None, "max": None}
        out.update({_pkey(p): None for p in PERCENTILES})
        out["min"] = None
        return out
    mean, se = _mean_se(v)
    out = {"n": int(v.size), "mean": mean, "se": se, "max": float(v.max())}
    pct = np.percentile(v, PERCENTILES)
    out.update({_pkey(p): float(q) for p, q in zip(PERCENTILES, pct)})
    out["min"] = float(v.min())
    return out


def _pkey(p: float) -> str:
    return f"p{p:g}"


def summarize(m: PositionMetrics, regions: Sequence[str] | None = None) -> dict[str, Any]:
    """A run summary in llama.cpp's KL report form.

    Keys: ``n``, ``approximate``, ``kl`` (mean, se, max, p99.9 ... p0.1, min),
    ``delta_p`` (the same plus ``rms`` and ``rms_se``), ``same_top_p`` (``p``, ``se`` =
    sqrt(p(1-p)/(n-1))), ``flips`` (count), ``flip_rate``, ``first_flip`` (position or None),
    ``mean_entropy``, ``mean_margin``, and ``flips_by_region`` / ``positions_by_region`` when
    ``regions`` (one region name per position) is given. Approximate (top-k) metrics add
    ``kl_bound: "lower"``, ``rank_lower_bounds`` and ``delta_p_unknown`` (counts)."""
    n = m.n
    if n == 0:
        raise AnalysisInputError("summarize: no positions", "empty")
    flips = m.flip
    n_flips = int(np.count_nonzero(flips))
    first = int(np.argmax(flips)) if n_flips else None

    kl = _distribution(m.kl)
    dp = _distribution(m.delta_p)
    d = m.delta_p[~np.isnan(m.delta_p)]
    if d.size:
        sq = d * d
        mse, mse_se = _mean_se(sq)
        rms = math.sqrt(mse)
        # delta method, as llama.cpp: se(rms) = se(mse) / (2 rms)
        rms_se = (mse_se / (2 * rms) if rms > 0 else 0.0) if mse_se is not None else None
    else:
        rms, rms_se = None, None
    dp["rms"] = rms
    dp["rms_se"] = rms_se

    p = float(np.count_nonzero(m.top1_agree)) / n
    same_se = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None

    out: dict[str, Any] = {
        "n": n,
        "approximate": bool(m.approximate),
        "kl": kl,
        "delta_p": dp,
        "same_top_p": {"p": p, "se": same_se},
        "flips": n_flips,
        "flip_rate": n_flips / n,
        "first_flip": first,
        "mean_entropy": _finite_mean(m.entropy),
        "mean_margin": _finite_mean(m.margin),
    }
    if m.approximate:
        # top-k metrics: KL over a coarsened partition is a lower bound of the full KL
        out["kl_bound"] = "lower"
        lb = m.rank_lower_bound
        out["rank_lower_bounds"] = int(np.count_nonzero(lb)) if lb is not None else 0
        out["delta_p_unknown"] = int(np.count_nonzero(np.isnan(m.delta_p)))
    if regions is not None:
        regions = list(regions)
        if len(regions) != n:
            raise AnalysisInputError(f"regions: {len(regions)} labels for {n} positions", "shape")
        by_region: dict[str, int] = {}
        count: dict[str, int] = {}
        for reg, f in zip(regions, flips.tolist()):
            if not isinstance(reg, str):
                raise AnalysisInputError(f"regions: labels must be strings, got {reg!r}", "format")
            count[reg] = count.get(reg, 0) + 1
            by_region[reg] = by_region.get(reg, 0) + int(f)
        order = [r for r in REGIONS if r in count] + sorted(set(count) - set(REGIONS))
        out["flips_by_region"] = {r: by_region[r] for r in order}
        out["positions_by_region"] = {r: count[r] for r in order}
    return out


def _finite_mean(v: np.ndarray) -> float | None:
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else None
