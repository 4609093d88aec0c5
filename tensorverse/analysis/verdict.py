"""Can I ship it? One verdict per shadow, with the turn as the unit (docs/verdict.md).

Each turn a shadow ran gives one paired observation against the noise floor (the secondary, the
primary's exact configuration, on the same turn):

* **tool-call break excess** (the primary endpoint), on *tool-calling turns* (the primary, the
  shadow or the secondary called a tool, or tried to: a malformed call counts): 1 if the shadow's free run's tool calls differ from
  the primary's, minus 1 if the secondary's do; a value in {-1, 0, 1};
* **flip excess**: the shadow's ``runtime``-class flip rate at that turn (forced, against the
  primary) minus the secondary's ``noise`` flip rate at that turn, in [-1, 1];
* **tool flip excess**: the same over the turn's ``tool_name`` and ``tool_args`` positions.

Flips cluster by turn; one turn is one observation, so a turn that flips 6 times weighs as one
bad turn, not as 6 independent trials. The observations, in the order the turns were recorded,
feed anytime-valid bounds (:mod:`tensorverse.analysis.sequential`): a user may look after every
turn, for weeks, and each bound still holds with the stated confidence. The decision, on the
primary endpoint:

``regression``  the lower bound of the tool-call break excess is above 0 ("mean <= 0" rejected);
``equivalent``  its upper bound is below the margin ("mean >= margin" rejected);
``undecided``   neither yet; ``turns_needed`` estimates the tool-calling turns still needed if
                traffic goes on as it has, ``hours_needed`` the hours at the observed rate, and
                :func:`turns_to_run` the turns of all kinds the shadow runs meanwhile (what its
                GPU time still costs: ``/verdict``'s ``gpu``).

Without a secondary the floor is 0 (the shadow's raw rates: conservative for ``equivalent``,
eager for ``regression``); the secondary itself is judged that way too, against no floor.

Position-level figures (flips over all positions, Newcombe's interval) stay as *descriptive*
statistics: they treat positions as independent trials and are not used to decide.

Pure: typed rows in (:class:`ComparisonLike`: the ``comparisons`` table of ``tensorverse export``
or the same rows built from a store by :mod:`tensorverse.exporters.comparison_rows`), typed
verdicts out. No I/O.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from tensorverse.analysis import sequential

__all__ = ["DECISIONS", "TOOL_REGIONS", "VerdictPolicy", "ComparisonLike", "TurnEvidence", "Interval",
           "ShadowVerdict", "evidence_from_rows", "decide", "verdicts", "verdicts_json", "fixed_sample_interval",
           "turns_to_run"]

DECISIONS = ("regression", "equivalent", "undecided")
TOOL_REGIONS = ("tool_name", "tool_args")
METHOD = "betting confidence sequence over turns (Waudby-Smith & Ramdas 2024), anytime-valid"


@dataclass(frozen=True)
class VerdictPolicy:
    """The confidence and the margins (excess per tool-calling turn / per position) that make a
    shadow ``equivalent``. Defaults a cautious user would choose: 95 %, at most half a percent
    more broken tool calls than the noise floor."""

    confidence: float = 0.95
    tool_call_break_margin: float = 0.005
    flip_margin: float = 0.001  # shown beside the decision, not deciding

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"confidence must lie in [0.5, 1), got {self.confidence}")
        for name in ("tool_call_break_margin", "flip_margin"):
            v = getattr(self, name)
            if not 0.0 < v < 1.0:
                raise ValueError(f"{name} must lie in (0, 1), got {v}")

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence


class ComparisonLike(Protocol):
    """One comparison as the ``comparisons`` export table has it (the fields read here, read-only:
    a row whose fields are dicts is one)."""

    @property
    def turn_id(self) -> str | None: ...
    @property
    def session_id(self) -> str | None: ...
    @property
    def turn_created_ns(self) -> int | None: ...
    @property
    def backend(self) -> str | None: ...
    @property
    def ref_backend(self) -> str | None: ...
    @property
    def role(self) -> str | None: ...
    @property
    def ref_role(self) -> str | None: ...
    @property
    def mode(self) -> str | None: ...
    @property
    def status(self) -> str | None: ...
    @property
    def noise_floor(self) -> bool | None: ...
    @property
    def n(self) -> int | None: ...
    @property
    def flips(self) -> int | None: ...
    @property
    def flips_by_class(self) -> Mapping[str, int] | None: ...
    @property
    def flips_by_region_class(self) -> Mapping[str, Mapping[str, int]] | None: ...
    @property
    def positions_by_region(self) -> Mapping[str, int] | None: ...
    @property
    def verdict(self) -> str | None: ...
    @property
    def ref_tool_calls(self) -> int | None: ...
    @property
    def cand_tool_calls(self) -> int | None: ...



@dataclass(frozen=True)
class TurnEvidence:
    """One shadow's paired evidence at one turn (None: that part was not run or failed)."""

    turn_id: str
    session_id: str | None
    created_ns: int
    positions: int | None = None  # forced positions compared with the primary
    flips: int | None = None  # the shadow's runtime-class flips there
    floor_positions: int | None = None
    floor_flips: int | None = None  # the secondary's flips (all noise) there
    tool_positions: int | None = None
    tool_flips: int | None = None
    floor_tool_positions: int | None = None
    floor_tool_flips: int | None = None
    tool_call_turn: bool = False  # the primary, the shadow or the secondary called a tool
    broke: bool | None = None  # the shadow's free-run tool calls differ from the primary's
    floor_broke: bool | None = None

    def break_excess(self) -> float | None:
        if not self.tool_call_turn or self.broke is None:
            return None
        return float(self.broke) - float(bool(self.floor_broke))

    def flip_excess(self) -> float | None:
        if not self.positions:
            return None
        floor = (self.floor_flips or 0) / self.floor_positions if self.floor_positions else 0.0
        return (self.flips or 0) / self.positions - floor

    def tool_flip_excess(self) -> float | None:
        if not self.tool_positions:
            return None
        floor = (self.floor_tool_flips or 0) / self.floor_tool_positions if self.floor_tool_positions else 0.0
        return (self.tool_flips or 0) / self.tool_positions - floor


@dataclass(frozen=True)
class Interval:
    """An endpoint's estimate (the mean over its turns) and anytime-valid bounds."""

    turns: int
    estimate: float | None
    low: float
    high: float
    margin: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShadowVerdict:
    backend: str
    role: str
    decision: str
    turns: int  # turns with a forced comparison against the primary
    tool_call_turns: int  # tool-calling turns with a free run
    turns_needed: int | None  # more tool-calling turns to a decision, about (None: not at this rate)
    hours_needed: float | None
    tool_call_break_excess: Interval
    flip_excess: Interval
    tool_flip_excess: Interval
    confidence: float
    floor_backend: str | None
    method: str
    tool_call_breaks: int = 0  # descriptive: the shadow's broken tool-calling turns
    floor_tool_call_breaks: int = 0
    positions: int = 0  # descriptive, position-level: not used to decide
    runtime_flips: int = 0
    floor_positions: int = 0
    floor_flips: int = 0
    tool_call_turns_per_hour: float | None = None
    first_ns: int | None = None
    last_ns: int | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("tool_call_break_excess", "flip_excess", "tool_flip_excess"):
            d[k] = getattr(self, k).as_dict()
        return d


# --------------------------------------------------------------------------- evidence


def _tool_counts(by_region_class: Mapping[str, Mapping[str, int]] | None,
                 positions_by_region: Mapping[str, int] | None, cls: str | None) -> tuple[int | None, int | None]:
    if positions_by_region is None:
        return None, None
    pos = sum(int(positions_by_region.get(r) or 0) for r in TOOL_REGIONS)
    if by_region_class is None:
        return pos, None
    flips = 0
    for r in TOOL_REGIONS:
        cell = by_region_class.get(r) or {}
        flips += sum(int(v) for v in cell.values()) if cls is None else int(cell.get(cls) or 0)
    return pos, flips


def _runtime_flips(c: ComparisonLike, *, all_classes: bool) -> int:
    by = c.flips_by_class
    if all_classes or by is None:  # the secondary's flips are all noise; unclassified: all
        return int(c.flips or 0)
    return int(by.get("runtime") or 0)


def evidence_from_rows(rows: Iterable[ComparisonLike], *, forced_refs: Sequence[str] = ("primary",)
                       ) -> tuple[dict[str, list[TurnEvidence]], dict[str, str], str | None]:
    """Per backend, its turns' evidence in recording order; the backends' roles; the secondary.

    Only ``ok`` comparisons count: free runs against the primary (``ref_role == "primary"``),
    forced runs against the first of ``forced_refs`` that the turn has (the proxy: the primary's
    recorded top-k; a replay: its reference backend's forced run). Rows that repeat (the same
    export read twice, replicas that exported the same store) count once."""
    seen: set[tuple[Any, ...]] = set()
    forced: dict[tuple[str, str], ComparisonLike] = {}
    free: dict[tuple[str, str], ComparisonLike] = {}
    roles: dict[str, str] = {}
    turns: dict[str, tuple[int, str | None]] = {}
    rank = {r: i for i, r in enumerate(forced_refs)}
    for c in rows:
        if c.status != "ok" or not c.backend or not c.turn_id or c.backend == c.ref_backend:
            continue
        if not (c.mode == "free" and c.ref_role == "primary") and not (c.mode == "forced" and c.ref_role in rank):
            continue
        key = (c.turn_id, c.backend, c.mode, c.ref_backend)
        if key in seen:
            continue
        seen.add(key)
        roles.setdefault(c.backend, c.role or "shadow")
        turns.setdefault(c.turn_id, (int(c.turn_created_ns or 0), c.session_id))
        if c.mode == "forced":
            old = forced.get((c.turn_id, c.backend))
            if old is None or rank[c.ref_role or ""] < rank[old.ref_role or ""]:
                forced[(c.turn_id, c.backend)] = c
        else:
            free[(c.turn_id, c.backend)] = c
    secondary = next((b for b, r in sorted(roles.items()) if r == "secondary"), None)
    order = sorted(turns, key=lambda t: (turns[t][0], t))
    out: dict[str, list[TurnEvidence]] = {}
    for b in sorted(roles):
        is_floor = b == secondary
        floor = None if is_floor else secondary
        ev: list[TurnEvidence] = []
        for t in order:
            fc, rc = forced.get((t, b)), free.get((t, b))
            if fc is None and rc is None:
                continue
            ffc = forced.get((t, floor)) if floor else None
            frc = free.get((t, floor)) if floor else None
            kw: dict[str, Any] = {}
            if fc is not None and fc.n:
                kw["positions"] = int(fc.n)
                kw["flips"] = _runtime_flips(fc, all_classes=is_floor)
                kw["tool_positions"], kw["tool_flips"] = _tool_counts(
                    fc.flips_by_region_class, fc.positions_by_region, None if is_floor else "runtime")
                if ffc is not None and ffc.n:
                    kw["floor_positions"] = int(ffc.n)
                    kw["floor_flips"] = _runtime_flips(ffc, all_classes=True)
                    kw["floor_tool_positions"], kw["floor_tool_flips"] = _tool_counts(
                        ffc.flips_by_region_class, ffc.positions_by_region, None)
            if rc is not None:
                calls = [rc.ref_tool_calls, rc.cand_tool_calls, frc.cand_tool_calls if frc is not None else 0]
                kw["broke"] = rc.verdict not in (None, "match")
                if frc is not None:
                    kw["floor_broke"] = frc.verdict not in (None, "match")
                # a malformed call where the primary called none is a break on a tool-calling turn
                kw["tool_call_turn"] = any((v or 0) > 0 for v in calls) or kw["broke"] or bool(kw.get("floor_broke"))
            created, sid = turns[t]
            ev.append(TurnEvidence(turn_id=t, session_id=sid, created_ns=created, **kw))
        out[b] = ev
    return out, roles, secondary


# --------------------------------------------------------------------------- the decision


def _interval(values: Sequence[float], alpha: float, margin: float | None) -> Interval:
    y = np.asarray(values, dtype=np.float64)
    b = sequential.bounds(y, alpha)
    return Interval(turns=b.n, estimate=b.estimate, low=b.low, high=b.high, margin=margin)


def decide(backend: str, role: str, evidence: Sequence[TurnEvidence], policy: VerdictPolicy = VerdictPolicy(),
           *, floor_backend: str | None = None) -> ShadowVerdict:
    """The verdict of one shadow from its turns' evidence (in recording order)."""
    alpha = policy.alpha
    breaks = [v for v in (e.break_excess() for e in evidence) if v is not None]
    flips = [v for v in (e.flip_excess() for e in evidence) if v is not None]
    tool = [v for v in (e.tool_flip_excess() for e in evidence) if v is not None]
    y = np.asarray(breaks, dtype=np.float64)
    margin = policy.tool_call_break_margin
    regression = bool(y.size) and sequential.rejects(y, 0.0, "lower", alpha)
    equivalent = bool(y.size) and sequential.rejects(y, margin, "upper", alpha)
    if regression and equivalent:  # both bounds tight around (0, margin): cannot happen at
        equivalent = False  # sane margins; regression is the cautious answer
    decision = "regression" if regression else "equivalent" if equivalent else "undecided"
    needed: float | None = 0.0
    if decision == "undecided":
        options = [sequential.turns_to_cross(y, 0.0, "lower", alpha),
                   sequential.turns_to_cross(y, margin, "upper", alpha)]
        finite = [o for o in options if o is not None]
        needed = min(finite) if finite else None
    tc_times = [e.created_ns for e in evidence if e.break_excess() is not None]
    rate = None
    if len(tc_times) >= 2 and tc_times[-1] - tc_times[0] >= 60e9:
        rate = (len(tc_times) - 1) / ((tc_times[-1] - tc_times[0]) / 3600e9)
    turns_needed = None if needed is None else int(math.ceil(needed))
    hours = None if turns_needed is None or rate is None else turns_needed / rate
    notes: list[str] = []
    if floor_backend is None:
        notes.append("no noise floor: raw rates (no secondary compared on these turns)"
                     if role != "secondary" else "the secondary: its own rates, against no floor")
    return ShadowVerdict(
        backend=backend, role=role, decision=decision,
        turns=sum(1 for e in evidence if e.positions), tool_call_turns=len(breaks),
        turns_needed=turns_needed, hours_needed=hours,
        tool_call_break_excess=_interval(breaks, alpha, margin),
        flip_excess=_interval(flips, alpha, policy.flip_margin),
        tool_flip_excess=_interval(tool, alpha, None),
        confidence=policy.confidence, floor_backend=floor_backend, method=METHOD,
        tool_call_breaks=sum(1 for e in evidence if e.tool_call_turn and e.broke),
        floor_tool_call_breaks=sum(1 for e in evidence if e.tool_call_turn and e.broke is not None
                                   and e.floor_broke),
        positions=sum(e.positions or 0 for e in evidence),
        runtime_flips=sum(e.flips or 0 for e in evidence if e.positions),
        floor_positions=sum(e.floor_positions or 0 for e in evidence if e.positions),
        floor_flips=sum(e.floor_flips or 0 for e in evidence if e.positions),
        tool_call_turns_per_hour=rate,
        first_ns=evidence[0].created_ns if evidence else None,
        last_ns=evidence[-1].created_ns if evidence else None,
        notes=notes)


def turns_to_run(v: ShadowVerdict) -> float | None:
    """The turns the shadow still runs, tool-calling or not, before its verdict is decided: 0 once
    decided; else ``turns_needed`` tool-calling turns at the share of its turns that called tools
    so far (None: no estimate, or no tool-calling turn seen yet)."""
    if v.decision != "undecided":
        return 0.0
    if v.turns_needed is None or not v.tool_call_turns:
        return None
    return v.turns_needed * max(v.turns, v.tool_call_turns) / v.tool_call_turns


def verdicts(rows: Iterable[ComparisonLike], policy: VerdictPolicy = VerdictPolicy(), *,
             backend: str | None = None, known: Mapping[str, str] | None = None,
             forced_refs: Sequence[str] = ("primary",)) -> list[ShadowVerdict]:
    """Every shadow's verdict (the secondary's last), or only ``backend``'s. ``known``: backends
    (name -> role) to judge even before they have a comparison (undecided, no turns);
    ``forced_refs``: as :func:`evidence_from_rows`."""
    ev, roles, secondary = evidence_from_rows(rows, forced_refs=forced_refs)
    for b, r in (known or {}).items():
        if b not in ev:
            ev[b], roles[b] = [], r
            if r == "secondary" and secondary is None:
                secondary = b
    out = []
    for b in sorted(ev, key=lambda b: (b == secondary, b)):
        if backend is not None and b != backend:
            continue
        floor = secondary if b != secondary and any(e.floor_positions or e.floor_broke is not None
                                                    for e in ev[b]) else None
        out.append(decide(b, roles[b], ev[b], policy, floor_backend=floor))
    return out


def verdicts_json(vs: Iterable[ShadowVerdict], policy: VerdictPolicy) -> dict[str, Any]:
    """The JSON object of ``tensorverse verdict --json`` and ``/verdict`` (no NaN or infinity)."""
    out = []
    for v in vs:
        d = v.as_dict()
        if d["hours_needed"] is not None and not math.isfinite(d["hours_needed"]):
            d["hours_needed"] = None
        out.append(d)
    return {"confidence": policy.confidence, "tool_call_break_margin": policy.tool_call_break_margin,
            "shadows": out}


def fixed_sample_interval(values: Sequence[float], clusters: Sequence[Any] | None = None, *,
                          confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0
                          ) -> tuple[float, float]:
    """A one-look interval of the mean per-turn excess: the cluster bootstrap (scipy's BCa) over
    sessions (``clusters``; each turn its own cluster when None). Valid at one fixed sample size
    only: for a single look, never for watching (docs/verdict.md)."""
    from scipy.stats import bootstrap

    y = np.asarray(values, dtype=np.float64)
    if y.size < 2:
        return -1.0, 1.0
    if clusters is None:
        sums, counts = y, np.ones_like(y)
    else:
        groups: dict[Any, list[float]] = defaultdict(list)
        for v, g in zip(y, clusters):
            groups[g].append(float(v))
        sums = np.array([sum(v) for v in groups.values()])
        counts = np.array([float(len(v)) for v in groups.values()])
        if sums.size < 2:
            return -1.0, 1.0
    if np.all(sums == sums[0] * counts / counts[0]):
        est = float(sums.sum() / counts.sum())
        return est, est

    def ratio(s: np.ndarray, c: np.ndarray, axis: int = -1) -> np.ndarray:
        return s.sum(axis=axis) / c.sum(axis=axis)

    res = bootstrap((sums, counts), ratio, paired=True, vectorized=True, confidence_level=confidence,
                    n_resamples=n_resamples, method="BCa", random_state=np.random.default_rng(seed))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        res = bootstrap((sums, counts), ratio, paired=True, vectorized=True, confidence_level=confidence,
                        n_resamples=n_resamples, method="percentile", random_state=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return lo, hi
