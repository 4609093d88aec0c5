"""Why did it flip? A class on every flip, and the excess flip rate (docs/attribution.md).

Every flip (forced: a position whose argmax differs from the reference's; free: the divergence
point, or a tool-call difference on identical tokens) gets exactly one class, the first that
applies in this order:

``tie``       the reference row gives its own top-1 token and the candidate's top-1 token
              exactly equal logits: rounding decided, any change flips it;
``near_tie``  the two logits are at most ``TieRule.ulps`` (default 1) representable values apart
              in the reference row's dtype, i.e. adjacent on the dtype's grid at that magnitude,
              or their difference is at most ``TieRule.nats`` (default 0: off). A float32 row
              whose every entry is bfloat16-exact (vLLM's bf16 logits widened) counts as
              bfloat16; rows given as uint16 are bfloat16 bit patterns;
``noise``     the same position also flips in a noise run (the secondary, which runs the
              primary's exact configuration, or a batch-noise probe);
``parser``    free mode only: the candidate's token ids equal the primary's but its parsed tool
              calls differ, or the primary's emitted ``tool_calls`` differ from what its own
              token ids parse to (:func:`parser_check`);
``runtime``   none of the above: attributable to the setting under test.

Steps between two values are counted on the dtype's ordered bit patterns (sign-magnitude mapped
to a monotone integer), so "one ulp at that magnitude" is exact across binade boundaries and
signs: 1.0 and the bfloat16 value just below it (0.99609375) are 1 step apart.

References that hold only top-k logprobs (the primary's recorded answer) are judged on the
logprobs themselves (float32 as vLLM returns them): equal logprobs are a ``tie``; adjacency is
counted on the logprobs' grid, which is finer than the bf16 logits they came from, so near-ties
there are found through ``TieRule.nats``. A candidate token missing from the reference's top-k
is never a tie.

:func:`excess_flip_rate`: the ``runtime``-class flip rate minus the noise floor's, with a
Newcombe hybrid score interval (method 10 of Newcombe 1998) built from the two Wilson score
intervals (scipy). Classification depends only on each position's own row: never on the order
of rows in the batch. No I/O happens in this module.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Collection, Iterable, Literal, Mapping, Sequence

import numpy as np

from tensorverse.analysis.intervals import wilson
from tensorverse.analysis.metrics import AnalysisInputError, widen_bf16



__all__ = [
    "FlipClass",
    "FLIP_CLASSES",
    "TieRule",
    "FlipAttribution",
    "ParserCheck",
    "ExcessFlipRate",
    "row_dtype",
    "grid_steps",
    "margin_class",
    "classify_forced",
    "classify_forced_topk",
    "classify_forced_sparse",
    "classify_free",
    "flips_by_class",
    "noise_flips",
    "parser_check",
    "excess_flip_rate",
]


class FlipClass(str, Enum):
    """The class of one flip (a ``str``: JSON-ready as its value)."""

    TIE = "tie"
    NEAR_TIE = "near_tie"
    NOISE = "noise"
    PARSER = "parser"
    RUNTIME = "runtime"

    def __str__(self) -> str:
        return self.value


#: The classes in precedence order (also the order of every ``flips_by_class``).
FLIP_CLASSES: tuple[str, ...] = tuple(c.value for c in FlipClass)

Mode = Literal["forced", "free"]


@dataclass(frozen=True)
class TieRule:
    """When a flip counts as a (near) tie.

    ``ulps``: two distinct logits at most this many representable values apart in the
    reference row's dtype are a ``near_tie`` (default 1: adjacent values; 0 turns it off).
    ``nats``: a logit difference at most this is a ``near_tie`` too (default 0.0: off)."""

    ulps: int = 1
    nats: float = 0.0

    def __post_init__(self) -> None:
        if int(self.ulps) != self.ulps or self.ulps < 0:
            raise AnalysisInputError(f"TieRule.ulps must be a non-negative integer, got {self.ulps!r}", "value")
        if not (math.isfinite(self.nats) and self.nats >= 0):
            raise AnalysisInputError(f"TieRule.nats must be a finite number >= 0, got {self.nats!r}", "value")

    def as_dict(self) -> dict[str, Any]:
        return {"ulps": int(self.ulps), "nats": float(self.nats)}


DEFAULT_RULE = TieRule()


@dataclass(frozen=True)
class FlipAttribution:
    """One classified flip.

    ``position``: output position (None for a free run's tool-call flip on identical tokens);
    ``ref_token`` / ``cand_token``: the reference's and the candidate's top-1 (forced) or emitted
    token (free); ``margin``: reference logit of ``ref_token`` minus that of ``cand_token``
    (nats; None when the reference does not give both); ``steps``: representable values between
    them in ``ref_dtype`` (None likewise)."""

    position: int | None
    flip_class: FlipClass
    mode: Mode
    ref_token: int | None = None
    cand_token: int | None = None
    margin: float | None = None
    steps: int | None = None
    ref_dtype: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["flip_class"] = self.flip_class.value
        return d


# --------------------------------------------------------------------------- dtypes and grids


def row_dtype(row: np.ndarray) -> str:
    """The dtype a logits row is judged in: ``bfloat16`` for uint16 bit patterns and for float32
    rows whose every entry is bfloat16-exact; else the array's own float dtype name."""
    a = np.asarray(row)
    if a.dtype == np.uint16:
        return "bfloat16"
    if a.dtype == np.float32:
        if not np.any(a.view(np.uint32) & np.uint32(0xFFFF)):
            return "bfloat16"
        return "float32"
    if a.dtype.kind != "f":
        raise AnalysisInputError(f"logits must be a float dtype or bf16 bit patterns, got {a.dtype}", "dtype")
    return a.dtype.name


_BITS = {"bfloat16": (np.float32, np.uint32, 16, 15), "float16": (np.float16, np.uint16, 0, 15),
         "float32": (np.float32, np.uint32, 0, 31), "float64": (np.float64, np.uint64, 0, 63)}


def _ordered(value: Any, dtype: str) -> int:
    """Monotone integer key of a float on ``dtype``'s grid (adjacent values differ by 1)."""
    ftype, utype, shift, sign_bit = _BITS[dtype]
    bits = int(np.asarray(value, dtype=ftype).reshape(1).view(utype)[0]) >> shift
    mag = bits & ((1 << sign_bit) - 1)
    return -mag if bits >> sign_bit else mag


def grid_steps(a: Any, b: Any, dtype: str) -> int:
    """The number of steps between a and b on ``dtype``'s grid (0 = equal, 1 = adjacent).

    ``a``/``b`` must be exactly representable in ``dtype`` (bfloat16 values as float32)."""
    if dtype not in _BITS:
        raise AnalysisInputError(f"unknown dtype {dtype!r} ({', '.join(_BITS)})", "value")
    return abs(_ordered(a, dtype) - _ordered(b, dtype))


def margin_class(a: float, b: float, dtype: str, rule: TieRule = DEFAULT_RULE) -> tuple[FlipClass | None, int, float]:
    """``tie`` / ``near_tie`` / None for two reference logits (its top-1's, the candidate's),
    with the steps between them and their difference in nats."""
    steps = grid_steps(a, b, dtype)
    margin = float(a) - float(b)
    if steps == 0:
        return FlipClass.TIE, 0, margin
    if steps <= rule.ulps or abs(margin) <= rule.nats:
        return FlipClass.NEAR_TIE, steps, margin
    return None, steps, margin


def _values_dtype(values: Iterable[float]) -> str:
    """The grid of API logprobs (floats from JSON): float32, as vLLM returns them, or float64
    when float32 cannot hold every value exactly. Never bfloat16: a logprob is a float32 value
    even when it happens to be bfloat16-exact (log-softmax of bf16 logits is computed in
    float32), so a bf16 step between two logprobs is many steps on their grid."""
    v = np.asarray(list(values), dtype=np.float64)
    if v.size == 0:
        return "float64"
    if not np.array_equal(v.astype(np.float32).astype(np.float64), v):
        return "float64"
    return "float32"


# --------------------------------------------------------------------------- forced mode


def _as_positions(positions: Sequence[int] | None, n: int) -> list[int]:
    if positions is None:
        return list(range(n))
    if len(positions) != n:
        raise AnalysisInputError(f"positions: {len(positions)} for {n} rows", "shape")
    return [int(p) for p in positions]


def _noise_mask(noise: Any, n: int) -> np.ndarray | None:
    if noise is None:
        return None
    m = np.asarray(noise, dtype=bool)
    if m.shape != (n,):
        raise AnalysisInputError(f"noise: expected {n} flags (one per position), got shape {m.shape}", "shape")
    return m


def classify_forced(ref_rows: Any, ref_top1: Any, cand_top1: Any, *, noise: Any = None,
                    positions: Sequence[int] | None = None,
                    rule: TieRule = DEFAULT_RULE) -> list[FlipAttribution]:
    """Classify every forced flip (``ref_top1 != cand_top1``) against full reference rows.

    ``ref_rows``: positions x vocabulary (float16/32/64, or uint16 bfloat16 bit patterns);
    ``ref_top1``/``cand_top1``: each side's argmax per position; ``noise``: per position, True
    where the noise run flips too (None: no noise run, so no ``noise`` class); ``positions``:
    the output position of each row (default 0..n-1). Only the rows of flips are read."""
    rows = np.asarray(ref_rows)
    if rows.ndim == 1:
        rows = rows.reshape(1, -1)
    r1 = np.asarray(ref_top1, dtype=np.int64).reshape(-1)
    c1 = np.asarray(cand_top1, dtype=np.int64).reshape(-1)
    n = rows.shape[0]
    if r1.shape != (n,) or c1.shape != (n,):
        raise AnalysisInputError(f"top-1 arrays must have one entry per row ({n})", "shape")
    pos = _as_positions(positions, n)
    nm = _noise_mask(noise, n)
    out: list[FlipAttribution] = []
    for i in np.flatnonzero(r1 != c1).tolist():
        row = rows[i]
        dtype = row_dtype(row)
        vals = widen_bf16(row)
        a, b = vals[r1[i]], vals[c1[i]]
        cls, steps, margin = margin_class(a, b, dtype, rule)
        if cls is None:
            cls = FlipClass.NOISE if nm is not None and nm[i] else FlipClass.RUNTIME
        out.append(FlipAttribution(pos[i], cls, "forced", int(r1[i]), int(c1[i]), margin, steps, dtype))
    return out


def classify_forced_topk(ref_topk: Sequence[Mapping[int, float]], ref_top1: Any, cand_top1: Any, *,
                         noise: Any = None, positions: Sequence[int] | None = None,
                         rule: TieRule = DEFAULT_RULE) -> list[FlipAttribution]:
    """:func:`classify_forced` for a reference that holds only top-k logprobs per position
    (``{token id: logprob}``, e.g. :func:`tensorverse.analysis.topk.parse_top_logprobs`)."""
    return _classify_known([(e, None) for e in ref_topk], ref_top1, cand_top1, noise, positions, rule,
                           "top-k entries")


def classify_forced_sparse(ref_kept: Sequence[tuple[Mapping[int, float], str]], ref_top1: Any,
                           cand_top1: Any, *, noise: Any = None, positions: Sequence[int] | None = None,
                           rule: TieRule = DEFAULT_RULE) -> list[FlipAttribution]:
    """:func:`classify_forced` for a reference that kept only some logits of each row (a compact
    row: its top k and a few extras, as raw logits of the row's dtype). ``ref_kept``: per position
    ``(logits by token id, the row's dtype)``.

    Where the candidate's top-1 was kept, the result is what :func:`classify_forced` gives on the
    full row. Where it was not, it lies below the reference's k-th logit: ``margin`` and ``steps``
    are None (unknown) and the flip is ``runtime`` or ``noise``. That is the full row's class too
    unless the reference's top k all lie within the tie rule of its top-1 (a row of exact ties
    that reach past the reduction's window travels in full: `tensorverse.capture.reduce`)."""
    return _classify_known(ref_kept, ref_top1, cand_top1, noise, positions, rule, "kept logits")


def _classify_known(known: Sequence[tuple[Mapping[int, float], str | None]], ref_top1: Any, cand_top1: Any,
                    noise: Any, positions: Sequence[int] | None, rule: TieRule, what: str) -> list[FlipAttribution]:
    """Classify each flip from the reference values known at its position: ``(values by token
    id, their grid)``, the grid None for API logprobs (then :func:`_values_dtype` of the two)."""
    r1 = np.asarray(ref_top1, dtype=np.int64).reshape(-1)
    c1 = np.asarray(cand_top1, dtype=np.int64).reshape(-1)
    n = r1.shape[0]
    if c1.shape != (n,) or len(known) != n:
        raise AnalysisInputError(f"{what} and top-1 arrays must have one entry per position ({n})", "shape")
    pos = _as_positions(positions, n)
    nm = _noise_mask(noise, n)
    out: list[FlipAttribution] = []
    for i in np.flatnonzero(r1 != c1).tolist():
        vals, grid = known[i]
        a, b = vals.get(int(r1[i])), vals.get(int(c1[i]))
        cls = steps = margin = dtype = None
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            dtype = grid or _values_dtype((a, b))
            cls, steps, margin = margin_class(a, b, dtype, rule)
        if cls is None:
            cls = FlipClass.NOISE if nm is not None and nm[i] else FlipClass.RUNTIME
        out.append(FlipAttribution(pos[i], cls, "forced", int(r1[i]), int(c1[i]), margin, steps, dtype))
    return out


def noise_flips(ref_top1: Any, noise_top1: Any) -> np.ndarray:
    """Per position: does the noise run's top-1 differ from the reference's?"""
    a = np.asarray(ref_top1, dtype=np.int64).reshape(-1)
    b = np.asarray(noise_top1, dtype=np.int64).reshape(-1)
    if a.shape != b.shape:
        raise AnalysisInputError(f"noise run: {b.shape[0]} positions for {a.shape[0]}", "shape")
    return a != b


# --------------------------------------------------------------------------- free mode


def classify_free(*, position: int | None, ref_token: int | None = None, cand_token: int | None = None,
                  ref_logits: tuple[float, float, str] | None = None,
                  noise_positions: Collection[int] = (), tool_calls_differ: bool = False,
                  primary_parser_mismatch: bool = False,
                  rule: TieRule = DEFAULT_RULE) -> FlipAttribution | None:
    """The class of a free run's flip, or None when it has none.

    ``position``: the divergence point (None: identical tokens); ``ref_logits``: the reference's
    logits (or logprobs) of ``ref_token`` and ``cand_token`` at that point and their dtype, when
    known; ``noise_positions``: positions where a noise run flips or diverges;
    ``tool_calls_differ``: the tool-call verdict against the primary is not a match;
    ``primary_parser_mismatch``: the primary's emitted tool calls differ from its ids' parse.
    Identical tokens with differing tool calls are a ``parser`` flip without a position."""
    if position is None:
        if tool_calls_differ:
            return FlipAttribution(None, FlipClass.PARSER, "free")
        return None
    cls = None
    steps = margin = dtype = None
    if ref_logits is not None and ref_token is not None and cand_token is not None:
        a, b, dtype = ref_logits
        if a is not None and b is not None and math.isfinite(a) and math.isfinite(b):
            cls, steps, margin = margin_class(a, b, dtype, rule)
    if cls is None:
        if position in noise_positions:
            cls = FlipClass.NOISE
        elif primary_parser_mismatch:
            cls = FlipClass.PARSER
        else:
            cls = FlipClass.RUNTIME
    return FlipAttribution(int(position), cls, "free", ref_token, cand_token, margin, steps, dtype)


def topk_pair(entry: Mapping[int, float] | None, ref_token: int | None,
              cand_token: int | None) -> tuple[float, float, str] | None:
    """The reference logprobs of two tokens from a top-k entry, with their grid; None when
    either is missing."""
    if not entry or ref_token is None or cand_token is None:
        return None
    a, b = entry.get(int(ref_token)), entry.get(int(cand_token))
    if a is None or b is None:
        return None
    return float(a), float(b), _values_dtype((a, b))


def flips_by_class(flips: Iterable[FlipAttribution | str | None]) -> dict[str, int]:
    """Counts per class, every class present (0 when none), in precedence order."""
    out = dict.fromkeys(FLIP_CLASSES, 0)
    for f in flips:
        if f is None:
            continue
        c = f.flip_class.value if isinstance(f, FlipAttribution) else FlipClass(f).value
        out[c] += 1
    return out


# --------------------------------------------------------------------------- the parser check


@dataclass(frozen=True)
class ParserCheck:
    """The primary's emitted tool calls against what its own token ids parse to.

    ``mismatch``: the verdict is not a match; ``verdict``/``differences`` from
    :func:`tensorverse.analysis.toolcalls.compare_tool_calls` (reference = the ids' parse,
    candidate = what was emitted); ``parsed_calls``/``emitted_calls``: counts."""

    mismatch: bool
    verdict: str
    parsed_calls: int
    emitted_calls: int
    differences: tuple[dict[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["differences"] = list(self.differences)
        return d


def parser_check(decoded_text: str, emitted_text: str | None, emitted_tool_calls: Any) -> ParserCheck:
    """Re-parse the primary's output ids (``decoded_text``: the ids detokenized) with the
    project's extractor and compare with what the primary emitted (its content text and its
    ``tool_calls``, as the agent saw them)."""
    from tensorverse.analysis.toolcalls import compare_tool_calls, extract_tool_calls

    parsed = extract_tool_calls(decoded_text or "")
    emitted = extract_tool_calls(emitted_text or "", openai_tool_calls=emitted_tool_calls or None)
    v = compare_tool_calls(parsed, emitted)
    return ParserCheck(mismatch=not v.match, verdict=v.verdict, parsed_calls=len(parsed.calls),
                       emitted_calls=len(emitted.calls),
                       differences=tuple(d.to_dict() for d in v.differences[:32]))


# --------------------------------------------------------------------------- excess flip rate


@dataclass(frozen=True)
class ExcessFlipRate:
    """``runtime``-class flip rate minus the noise floor's, with a two-sided interval.

    ``method``: ``newcombe_wilson`` (Newcombe's hybrid score interval from two Wilson score
    intervals, without continuity correction)."""

    runtime_flips: int
    n: int
    noise_flips: int
    noise_n: int
    rate: float
    noise_rate: float
    excess: float
    low: float
    high: float
    confidence: float
    method: str = "newcombe_wilson"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def excess_flip_rate(runtime_flips: int, n: int, noise_flips: int, noise_n: int, *,
                     confidence: float = 0.95) -> ExcessFlipRate:
    """Excess flip rate p1 - p2 of a backend (``runtime`` flips over compared positions) over
    the noise floor (the secondary's ``noise`` flips over its positions) with Newcombe's hybrid
    score interval: with (l_i, u_i) the Wilson interval of p_i,
    low = d - sqrt((p1 - l1)^2 + (u2 - p2)^2), high = d + sqrt((u1 - p1)^2 + (p2 - l2)^2)."""
    for name, k, m in (("runtime", runtime_flips, n), ("noise", noise_flips, noise_n)):
        if int(m) != m or int(k) != k or m <= 0 or not 0 <= k <= m:
            raise AnalysisInputError(f"{name}: need 0 <= flips <= positions and positions > 0, got {k}/{m}", "value")
    if not 0.0 < confidence < 1.0:
        raise AnalysisInputError(f"confidence must lie in (0, 1), got {confidence}", "value")
    x1, n1, x2, n2 = int(runtime_flips), int(n), int(noise_flips), int(noise_n)
    p1, p2 = x1 / n1, x2 / n2
    l1, u1 = wilson(x1, n1, confidence)  # type: ignore[misc]  # n > 0: an interval, never None
    l2, u2 = wilson(x2, n2, confidence)  # type: ignore[misc]
    d = p1 - p2
    low = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    high = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return ExcessFlipRate(x1, n1, x2, n2, p1, p2, d, low, high, float(confidence))
