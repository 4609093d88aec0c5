"""Compare, then keep what is evidence: a turn's full rows, compacted once its comparisons exist.

The comparisons of a turn (`tensorverse.shadow.compare`) are computed from its full rows, so
they are exact; after that, most full rows are no longer needed to know anything. Compaction
replaces the rows that are not evidence by their compact form (`tensorverse.store.compact`:
the top-k logits with their ids, the float64 log-sum-exp, the run's and the primary's token)
and keeps **in full, in every forced run of the turn** (both sides of every comparison):

* ``flip``: every forced flip of every class (the comparisons' ``flips``);
* ``divergence``: every free run's divergence position (kept in the free run too);
* ``close``: the close calls: rows whose top two logits are less than ``close_nats`` apart
  (in any forced run; in a free run, that run's row), the closest first, at most
  ``close_share`` of the positions (a flat model would otherwise keep most of its rows);
* ``kl``: the ``top_kl`` highest-KL positions (KL above 0) of each forced comparison;
* ``sample``: a seeded random sample (``sample`` of the positions, chosen by a hash of the
  seed, the turn id and the position: the same positions in every run and on every rerun),
  for re-analysis later.

Sessions that are pinned are never compacted. A kept row of a run that is not the reference is
re-encoded as a delta (``codec.encode_row(row, ref=...)``) against the row at the same position
of its *delta reference* (forced runs: the comparisons' reference run; free runs: the same
backend's forced run, whose prefix is the same until they diverge) when that row is kept in full
too and the delta is smaller. The ``compacted`` record of the turn says, per run, which positions
are full, which are deltas and against which run, and why each position was kept; readers decode
through it (`tensorverse.store.stored_rows`). A reference is never compacted from under a delta:
a turn is compacted once, all its runs in one transaction (`Store.apply_compaction`), and only
deleted whole (with its session).

:func:`plan_evidence` is pure (comparisons and per-row facts in, positions and reasons out);
:func:`plan_compaction` reads a turn's rows, plans and encodes, and writes nothing (so it runs
on a read-only store, in another process: the proxy's analysis workers); :func:`compact_turn`
plans and commits; :func:`compact_store` walks the turns that are due (oldest sessions first),
planning each turn in the caller's thread or with the planner it is given.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from tensorverse.analysis.metrics import widen_bf16
from tensorverse.store.codec import blob_info, decode_row, encode_row
from tensorverse.store.compact import compact_row, encode_compact
from tensorverse.store.records import CompactedRun, Compaction, Comparison, Run
from tensorverse.store.store import CompactionConflict, RowChange

if TYPE_CHECKING:
    from tensorverse.store.store import Store

__all__ = ["EvidencePolicy", "RowFacts", "EvidencePlan", "CompactionResult", "CompactionPlan", "plan_evidence",
           "plan_compaction", "apply_plan", "compact_turn", "compact_store", "due_turns", "sampled", "Planner"]

log = logging.getLogger("tensorverse.store.compaction")

REASONS = ("flip", "divergence", "close", "kl", "sample")


@dataclass(frozen=True)
class EvidencePolicy:
    """What compaction keeps in full (see the module docstring); ``[retention]`` in the config."""

    topk: int = 20  # logits kept per compacted row
    close_nats: float = 0.1  # top-2 logit gap under which a row is a close call
    close_share: float = 0.02  # at most this share of a run's positions kept as close calls (closest first)
    top_kl: int = 1  # highest-KL positions (KL > 0) kept per forced comparison
    sample: float = 0.005  # share of positions kept for re-analysis
    seed: int = 0
    delta: bool = True  # kept rows of other runs as deltas against their reference's row
    after_s: float = 120.0  # a turn is compacted this long after it was recorded

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= 4096:
            raise ValueError("topk must be in 1..4096")
        if self.close_nats < 0 or self.top_kl < 0 or self.after_s < 0:
            raise ValueError("close_nats, top_kl and after_s must be >= 0")
        if not 0.0 <= self.sample <= 1.0 or not 0.0 <= self.close_share <= 1.0:
            raise ValueError("sample and close_share must be in [0, 1]")


def sampled(seed: int, turn_id: str, position: int, share: float) -> bool:
    """Whether ``position`` of ``turn_id`` is in the seeded re-analysis sample."""
    if share <= 0:
        return False
    return zlib.crc32(f"{seed}:{turn_id}:{position}".encode()) < share * 2**32


@dataclass(frozen=True)
class RowFacts:
    """What compaction reads off one full row before planning."""

    run_id: str
    position: int
    gap: float  # top-1 minus top-2 logit (nats); inf for a one-entry row, nan for a bad row


@dataclass
class EvidencePlan:
    """Positions kept in full with their reasons: ``forced`` applies to every forced run of the
    turn, ``free`` per free run id."""

    forced: dict[int, set[str]] = field(default_factory=dict)
    free: dict[str, dict[int, set[str]]] = field(default_factory=dict)

    def keep_forced(self, p: int, why: str) -> None:
        self.forced.setdefault(int(p), set()).add(why)

    def keep_free(self, run_id: str, p: int, why: str) -> None:
        self.free.setdefault(run_id, {}).setdefault(int(p), set()).add(why)

    def kept(self, run: Run) -> dict[int, set[str]]:
        return self.forced if run.mode == "forced" else self.free.get(run.id, {})


def _closest(gaps: Mapping[int, float], share: float, n: int) -> list[int]:
    """The positions of the smallest gaps, at most ``share`` of ``n`` (at least one)."""
    cap = max(1, int(share * n)) if share > 0 else 0
    return [p for p, _ in sorted(gaps.items(), key=lambda kv: (kv[1], kv[0]))[:cap]]


def plan_evidence(turn_id: str, runs: Sequence[Run], comparisons: Sequence[Comparison],
                  facts: Iterable[RowFacts], policy: EvidencePolicy, n_positions: int) -> EvidencePlan:
    """Which positions stay full, and why (pure). ``n_positions``: the primary's token count."""
    plan = EvidencePlan()
    mode_of = {r.id: r.mode for r in runs}
    for c in comparisons:
        if c.status != "ok":
            continue
        if c.mode == "forced":
            for p in c.flips or ():
                plan.keep_forced(p, "flip")
            kl = (c.metrics or {}).get("kl")
            if kl and policy.top_kl:
                pos = c.positions if c.positions is not None else list(range(len(kl)))
                vals = np.asarray([np.nan if v is None else v for v in kl], dtype=np.float64)
                order = np.argsort(-np.nan_to_num(vals, nan=-np.inf), kind="stable")[: policy.top_kl]
                for i in order:
                    if vals[i] > 0:  # an infinite KL (the candidate gave the token no mass) too
                        plan.keep_forced(pos[int(i)], "kl")
        elif c.mode == "free" and c.first_flip is not None:
            plan.keep_forced(c.first_flip, "divergence")
            plan.keep_free(c.run_id, c.first_flip, "divergence")
    # close calls: the closest of the rows under close_nats, at most close_share of the positions
    forced_gap: dict[int, float] = {}
    free_gap: dict[str, dict[int, float]] = {}
    for f in facts:
        gap = -1.0 if np.isnan(f.gap) else f.gap  # a row with NaN/inf: always kept
        if not gap < policy.close_nats:
            continue
        mode = mode_of.get(f.run_id)
        if mode == "forced":
            forced_gap[f.position] = min(gap, forced_gap.get(f.position, gap))
        elif mode == "free":
            free_gap.setdefault(f.run_id, {})[f.position] = gap
    for p in _closest(forced_gap, policy.close_share, n_positions):
        plan.keep_forced(p, "close")
    lengths = {r.id: len(r.token_ids) for r in runs}
    for rid, gaps in free_gap.items():
        for p in _closest(gaps, policy.close_share, lengths.get(rid, 0)):
            plan.keep_free(rid, p, "close")
    for p in range(n_positions):
        if sampled(policy.seed, turn_id, p, policy.sample):
            plan.keep_forced(p, "sample")
    for r in runs:
        if r.mode == "free":
            for p in range(len(r.token_ids)):
                if sampled(policy.seed, turn_id, p, policy.sample):
                    plan.keep_free(r.id, p, "sample")
    return plan


@dataclass(frozen=True)
class CompactionResult:
    turn_id: str
    status: str  # compacted, skipped (with why), conflict
    why: str = ""
    rows_full: int = 0
    rows_delta: int = 0
    rows_compact: int = 0
    bytes_before: int = 0
    bytes_after: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after


def _gap(x: np.ndarray) -> float:
    if x.size < 2:
        return float("inf")
    top2 = np.partition(x, x.size - 2)[-2:]
    if not np.all(np.isfinite(top2)):
        return float("nan")
    return float(top2[1]) - float(top2[0])


def _delta_refs(runs: Sequence[Run], reference: str | None) -> dict[str, str]:
    forced_by_backend = {r.backend: r.id for r in runs if r.mode == "forced"}
    out: dict[str, str] = {}
    for r in runs:
        if r.mode == "forced" and reference is not None and r.id != reference:
            out[r.id] = reference
        elif r.mode == "free" and r.backend in forced_by_backend:
            out[r.id] = forced_by_backend[r.backend]
    return out


@dataclass(frozen=True)
class CompactionPlan:
    """What compacting one turn would write: the turn's ``compacted`` record and its row changes
    (``result`` says what it would do; a skipped turn has no record and no changes)."""

    result: CompactionResult
    record: Compaction | None = None
    changes: tuple[RowChange, ...] = ()


#: plans one turn: ``(turn_id, policy, now_ns) -> CompactionPlan`` (:func:`plan_compaction` over a store)
Planner = Callable[[str, EvidencePolicy, int], CompactionPlan]


def compact_turn(store: Store, turn_id: str, policy: EvidencePolicy, *, now_ns: int | None = None,
                 dry_run: bool = False, planner: Planner | None = None) -> CompactionResult:
    """Compact one turn (see the module docstring): plan it (read and encode: on the caller's
    thread, or by ``planner``), then one write transaction. Skips a turn that is compacted
    already, whose session is pinned, that is younger than ``policy.after_s``, or whose runs are
    not all compared."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    plan = (planner(turn_id, policy, now_ns) if planner is not None
            else plan_compaction(store, turn_id, policy, now_ns=now_ns))
    if dry_run:
        return plan.result
    return apply_plan(store, plan)


def apply_plan(store: Store, plan: CompactionPlan) -> CompactionResult:
    """Commit a plan in one transaction; ``conflict`` when a row changed since it was read."""
    if plan.record is None:
        return plan.result
    try:
        store.apply_compaction(plan.result.turn_id, plan.record, list(plan.changes)).result()
    except CompactionConflict as e:
        return CompactionResult(plan.result.turn_id, "conflict", str(e))
    return plan.result


def _skip(turn_id: str, why: str) -> CompactionPlan:
    return CompactionPlan(CompactionResult(turn_id, "skipped", why))


def plan_compaction(store: Store, turn_id: str, policy: EvidencePolicy, *, now_ns: int | None = None) -> CompactionPlan:
    """What compacting one turn writes (see :func:`compact_turn`), read from ``store`` (which
    may be open read-only) without writing anything."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    if store.compaction(turn_id) is not None:
        return _skip(turn_id, "compacted already")
    turn = store.get_turn(turn_id)
    if turn.session_id:
        try:
            if store.get_session(turn.session_id).pinned:
                return _skip(turn_id, "pinned")
        except KeyError:
            pass
    if (now_ns - int(turn.created_ns or 0)) < policy.after_s * 1e9:
        return _skip(turn_id, "recent")
    runs = list(store.iter_runs(turn_id))
    with_rows = [r for r in runs if r.mode in ("forced", "free") and store.count_rows(r.id)]
    if not with_rows:
        return _skip(turn_id, "no rows")
    comparisons = [c for r in runs for c in store.iter_comparisons(r.id)]
    compared = {c.run_id for c in comparisons}
    primary = next((r for r in runs if r.mode == "recorded"), None)
    refs = {c.ref_run_id for c in comparisons if c.mode == "forced" and c.kind == "full" and c.status == "ok"}
    latest: dict[tuple[str, str], Run] = {}  # what the comparisons compare (an older run of the same
    for r in with_rows:                       # backend and mode, e.g. a retry's, is not evidence)
        cur = latest.get((r.backend, r.mode))
        if cur is None or r.created_ns >= cur.created_ns:
            latest[(r.backend, r.mode)] = r
    uncompared = [r for r in latest.values() if r.status == "ok" and r.id not in compared and r.id not in refs]
    if primary is None or uncompared:
        return _skip(turn_id, "not compared yet")
    reference = sorted(refs)[0] if len(refs) == 1 else None
    tokens = list(primary.token_ids)

    # pass 1: every row's facts and compact form (one row decoded at a time)
    facts: list[RowFacts] = []
    stored: dict[str, dict[int, tuple[int, bytes, bytes]]] = {}  # run -> pos -> (len, tail, compact)
    before = 0
    for r in with_rows:
        for p, blob in store.read_rows(r.id):
            rec = f"{r.id}@{p}"
            info = blob_info(blob, record=rec)
            if info["needs_ref"]:
                return _skip(turn_id, f"row {rec} is a delta already")
            x = widen_bf16(decode_row(blob, record=rec)).reshape(-1)
            extra = [t for t in (r.token_ids[p] if p < len(r.token_ids) else None,
                                 tokens[p] if p < len(tokens) else None) if t is not None]
            c = compact_row(x, k=min(policy.topk, x.size), extra=extra, dtype=info["dtype"],
                            fingerprint=info["crc32"])
            facts.append(RowFacts(r.id, p, _gap(x)))
            stored.setdefault(r.id, {})[p] = (len(blob), bytes(blob[-4:]), encode_compact(c))
            before += len(blob)
    plan = plan_evidence(turn_id, with_rows, comparisons, facts, policy, len(tokens))

    # pass 2: the kept rows of runs with a delta reference, re-encoded where that pays
    delta_ref = _delta_refs(list(latest.values()), reference) if policy.delta else {}
    changes: list[RowChange] = []
    runs_out: dict[str, Any] = {}
    n_full = n_delta = n_compact = 0
    after = 0
    current = {r.id for r in latest.values()}
    for r in with_rows:
        kept = plan.kept(r) if r.id in current else {}
        ref_id = delta_ref.get(r.id)
        ref_run = next((x for x in with_rows if x.id == ref_id), None)
        ref_kept = plan.kept(ref_run) if ref_run is not None else {}
        full, deltas, compacted = [], [], []
        rid = r.id
        for p, (length, tail, cblob) in sorted(stored.get(rid, {}).items()):
            if p not in kept:
                changes.append(RowChange(rid, p, length, tail, compact=cblob))
                compacted.append(p)
                after += len(cblob)
                continue
            full.append(p)
            new = None
            if ref_run is not None and p in ref_kept and p in stored.get(ref_run.id, {}):
                row = decode_row(store.read_row(rid, p), record=f"{rid}@{p}")
                ref_row = decode_row(store.read_row(ref_run.id, p), record=f"{ref_run.id}@{p}")
                if row.shape == ref_row.shape and row.dtype == ref_row.dtype:
                    enc = encode_row(row, ref=ref_row)
                    if blob_info(enc)["needs_ref"] and len(enc) < length:
                        new = enc
            if new is not None:
                changes.append(RowChange(rid, p, length, tail, full=new))
                deltas.append(p)
                after += len(new)
            else:
                after += length
        n_full += len(full) - len(deltas)
        n_delta += len(deltas)
        n_compact += len(compacted)
        runs_out[r.id] = CompactedRun(backend=r.backend, mode=r.mode, full=full, delta=deltas,
                                      delta_ref=ref_run.id if deltas and ref_run is not None else None,
                                      compact=len(compacted), topk=policy.topk)
    record = Compaction(
        turn_id=turn_id, at_ns=now_ns, policy=asdict(policy), reference_run=reference, runs=runs_out,
        reasons={str(p): sorted(w) for p, w in sorted(plan.forced.items())},
        free_reasons={rid: {str(p): sorted(w) for p, w in sorted(d.items())} for rid, d in plan.free.items()},
        bytes_before=before, bytes_after=after)
    result = CompactionResult(turn_id, "compacted", "", n_full, n_delta, n_compact, before, after)
    return CompactionPlan(result, record, tuple(changes))


def due_turns(store: Store, policy: EvidencePolicy, *, now_ns: int | None = None) -> Iterable[str]:
    """Turns that may be compacted, oldest session first: not compacted, not pinned, recorded at
    least ``after_s`` ago."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    cutoff = int(now_ns - policy.after_s * 1e9)
    for s in store.iter_sessions(until_ns=cutoff + 1):
        if s.pinned:
            continue
        for tid in store.turn_ids(s.id):
            if store.compaction(tid) is None:
                yield tid


def compact_store(store: Store, policy: EvidencePolicy, *, now_ns: int | None = None, dry_run: bool = False,
                  limit: int | None = None, progress: Callable[[CompactionResult], None] | None = None,
                  planner: Planner | None = None) -> list[CompactionResult]:
    """Compact every due turn (at most ``limit``); one transaction per turn; ``planner``: who
    plans each turn (default: this thread, :func:`plan_compaction`)."""
    out: list[CompactionResult] = []
    for tid in due_turns(store, policy, now_ns=now_ns):
        if limit is not None and len([r for r in out if r.status == "compacted"]) >= limit:
            break
        try:
            r = compact_turn(store, tid, policy, now_ns=now_ns, dry_run=dry_run, planner=planner)
        except KeyError as e:  # the turn or its session went while we walked (pruned, merged)
            r = CompactionResult(tid, "skipped", f"gone: {e}")
        out.append(r)
        if progress is not None:
            progress(r)
    if any(r.status == "compacted" for r in out) and not dry_run:
        store.note_space_freed()
    return out
