"""Turn the stored runs of one turn into comparisons (candidate vs reference), stored with
``store.put_comparison(run_id, ref_run_id, result)``.

The reference for **forced** runs (aligned, position by position):

1. the forced run of the ``secondary`` (the primary's exact config on another server) when one
   ran, else of a designated ``reference`` backend: full-vocabulary rows on both sides give exact
   metrics (``kind: full``); when either side has only API top-k, the metrics come from top-k
   (``kind: topk``, ``approximate``);
2. the primary's own recorded top-k logprobs (the ``recorded`` run): always top-k, approximate.
   Every forced run is also compared with the primary this way when the primary's top-k was
   recorded, so candidates and the secondary are measured alike: the secondary's comparison with
   the primary is the **noise floor** (``noise_floor: true``), and each candidate's comparison with
   the primary carries a ``noise`` verdict against it (:mod:`tensorverse.analysis.noise`).

**Free** runs are compared with the primary's recorded output: divergence point and common prefix
(:func:`tensorverse.analysis.flips.free_divergence`), the tool-call verdict of the candidate's
text against the primary's (:func:`tensorverse.analysis.toolcalls.compare_tool_calls`), and
whether the branch happens where the same backend's forced run first preferred another token than
the primary's (``forced_departure``, ``confirms_forced``).

A chat-template mismatch recorded on a run is carried as ``template_mismatch`` (never counted as
a flip). Runs refused by the same-dictionary check have no comparisons.

The results are typed records, as the store reads them back:
:class:`~tensorverse.store.records.ForcedComparison` and
:class:`~tensorverse.store.records.FreeComparison` (failed comparisons too, with ``status:
error`` and ``error``). Fields (forced): ``run_id``, ``ref_run_id``, ``turn_id``, ``mode``,
``kind`` (``full``/``topk``), ``backend``, ``ref_backend``, ``role``, ``ref_role``,
``approximate``, ``noise_floor``, ``n``, ``positions``
(compared output positions), ``incomplete`` (rows missing on either side), ``summary``
(:func:`tensorverse.analysis.metrics.summarize`, with regions), ``flips`` (positions),
``first_flip``, ``flip_tokens`` (per flip: position, token, ref_top1, cand_top1), ``metrics``
(per-position columns), ``regions``, ``template_mismatch``, ``noise`` (candidate vs noise floor),
``flip_classes`` (one class per entry of ``flips``: :mod:`tensorverse.analysis.attribution`),
``flips_by_class`` (``summary`` has ``flips_by_region_class``; comparisons stored before
2026-12-05 also have ``flips_by_class`` there), ``attribution`` (the tie
rule, the noise source, per flip its margin, steps and dtype), and for candidates against the
primary ``excess`` (runtime-class flip rate minus the noise floor's, with its 95 % interval).
Free: ``divergence`` (``position``, ``common_prefix``, ``kind``, ``ref_token``, ``cand_token``...),
``common_prefix``, ``diverged``, ``region`` (of the primary's output at the divergence, when its
pieces are known), ``tool_calls`` (verdict dict), ``verdict``, ``forced_departure``,
``confirms_forced``, ``template_mismatch``, ``flip_class`` (None: no flip), ``flips_by_class``,
``attribution``. All of these are optional for readers: comparisons stored before them still read.

The noise run behind the ``noise`` class is the secondary: the positions where its forced run
flips against the primary's top-k (and where its free run diverges, for free flips).
"""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Collection, Iterable, Mapping, Sequence

import numpy as np

from tensorverse.analysis.attribution import (
    DEFAULT_RULE,
    FlipAttribution,
    TieRule,
    classify_forced,
    classify_forced_sparse,
    classify_forced_topk,
    classify_free,
    excess_flip_rate,
    flips_by_class,
    row_dtype,
    topk_pair,
)
from tensorverse.analysis.flips import forced_flips, free_divergence
from tensorverse.analysis.metrics import (AnalysisInputError, PositionMetrics, position_metrics, summarize,
                                          widen_bf16)
from tensorverse.analysis.noise import compare_flip_rates
from tensorverse.analysis.regions import region_at, tag_regions
from tensorverse.analysis.toolcalls import compare_tool_calls, extract_tool_calls
from tensorverse.analysis.topk import parse_top_logprobs, topk_position_metrics
from tensorverse.store import records
from tensorverse.store.records import Comparison, ForcedComparison, FreeComparison, Run
from tensorverse.store.compact import CompactRow, compact_row, decode_compact
from tensorverse.store.stored_rows import RowCompacted, StoredRows

if TYPE_CHECKING:
    from tensorverse.store import Store

__all__ = ["compare_turn", "compare_runs", "put_comparisons", "select_reference", "load_rows", "latest_runs",
           "CHUNK", "TurnCompacted"]

log = logging.getLogger("tensorverse.shadow")

CHUNK = 64  # rows decoded and compared at a time (64 x 151,936 float32 = 39 MB per side)
_REF_ROLES = ("secondary", "reference")
RunLike = Run | Mapping[str, Any]  # a run record, typed or as stored (decoded on entry)


def latest_runs(runs: Iterable[RunLike]) -> dict[tuple[str, str], Run]:
    """The latest run per (backend, mode)."""
    out: dict[tuple[str, str], Run] = {}
    for r in map(records.run, runs):
        key = (r.backend, r.mode)
        cur = out.get(key)
        if cur is None or r.created_ns >= cur.created_ns:
            out[key] = r
    return out


def _full(run: Run | None) -> bool:
    return run is not None and run.status == "ok" and run.capture == "full"


def _has_topk(run: Run | None, n: int) -> bool:
    tl = run.top_logprobs if run is not None else None
    return isinstance(tl, list) and len(tl) >= n and all(e for e in tl[:n])


def select_reference(forced: Sequence[RunLike], roles: Mapping[str, str] | None = None) -> Run | None:
    """The forced reference run: a secondary's, else a reference's; full capture preferred."""
    roles = roles or {}
    ok = [r for r in map(records.run, forced) if r.status == "ok"]
    for role in _REF_ROLES:
        cands = sorted((r for r in ok if roles.get(r.backend, r.role) == role),
                       key=lambda r: (not _full(r), r.backend))
        if cands:
            return cands[0]
    return None


class TurnCompacted(AnalysisInputError):
    """The turn's rows were compacted (`tensorverse.store.compaction`): its stored comparisons
    were computed from the full rows; recomputing them from what is left would guess."""


def _refuse_compacted(store: Store, turn_id: str | None) -> None:
    rec = store.compaction(turn_id) if turn_id and hasattr(store, "compaction") else None
    if rec is not None:
        why = "pruned by [retention]" if rec.rows_pruned else "compacted"
        raise TurnCompacted(f"turn {turn_id}: its rows were {why}; its stored comparisons are the exact "
                            "ones (computed from the full rows) and are not recomputed", "compacted")


def load_rows(store: Store, run_id: str, positions: Sequence[int]) -> np.ndarray:
    """Decode the rows of ``positions`` of a run into one float32 matrix (deltas through
    their reference run; a compacted position raises `RowCompacted`)."""
    src = StoredRows(store)
    rows = [widen_bf16(src.row(run_id, p)) for p in positions]
    if not rows:
        return np.zeros((0, 0), np.float32)
    widths = {r.shape[-1] for r in rows}
    if len(widths) != 1:
        raise AnalysisInputError(f"run {run_id}: rows of different widths {sorted(widths)}", "shape")
    return np.stack([r.reshape(-1) for r in rows]).astype(np.float32, copy=False)


def _row_positions(store: Store, run: Run, n: int) -> list[int]:
    """Positions < n whose row the run has in the store, in full or (reduced at the source) as
    its compact form."""
    rows = run.rows or {}
    if rows.get("complete") and rows.get("expected") == n:
        return list(range(n))
    compact = {p for p, _ in store.read_compact_rows(run.id)} if hasattr(store, "read_compact_rows") else set()
    have = []
    for p in range(n):
        if p not in compact:
            try:
                store.read_row(run.id, p)
            except KeyError:
                continue
        have.append(p)
    return have


def _concat(parts: list[PositionMetrics]) -> PositionMetrics:
    if len(parts) == 1:
        return parts[0]

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    lower = [p.rank_lower_bound if p.rank_lower_bound is not None else np.zeros(p.n, bool) for p in parts]
    approximate = any(p.approximate for p in parts)
    return PositionMetrics(
        top1_agree=cat("top1_agree"), kl=cat("kl"), delta_p=cat("delta_p"), margin=cat("margin"),
        rank=cat("rank"), entropy=cat("entropy"), ref_top1=cat("ref_top1"),
        cand_top1=cat("cand_top1"), tokens=cat("tokens"), approximate=approximate,
        rank_lower_bound=np.concatenate(lower) if approximate else None,
    )


def _load_side(src: StoredRows, run_id: str, ps: Sequence[int]) -> tuple[dict[int, np.ndarray], dict[int, CompactRow]]:
    """The rows of ``ps``: full (float32) where stored in full, else their compact form (the
    run's compact rows read in one pass: with evidence at the source most rows are compact)."""
    full: dict[int, np.ndarray] = {}
    compact: dict[int, CompactRow] = {}
    blobs = dict(src.store.read_compact_rows(run_id)) if hasattr(src.store, "read_compact_rows") else {}
    for p in ps:
        if p in blobs and src.compaction_of(run_id) is None:  # reduced at the source
            compact[p] = decode_compact(blobs[p], record=f"{run_id}@{p}")
            continue
        try:
            full[p] = widen_bf16(src.row(run_id, p)).reshape(-1).astype(np.float32, copy=False)
        except RowCompacted as e:
            if e.compact is None:  # pruned: nothing left to compare
                raise
            compact[p] = e.compact
    return full, compact


def _own_top1(full: dict[int, np.ndarray], compact: dict[int, CompactRow], p: int) -> int:
    """A run's own top-1 at ``p``: its full row's argmax, or its compact row's first id (a row
    reduced at the source knows its top-1 exactly)."""
    return int(compact[p].ids[0]) if p in compact else int(np.argmax(full[p]))


def _as_compact(side: dict[int, np.ndarray], compact: dict[int, CompactRow], p: int,
                other: CompactRow | None, token: int) -> CompactRow:
    """Position ``p`` of one side as a compact row: its own, or its full row's with the other
    side's kept ids (so each id the other side knows is known here exactly)."""
    if p in compact:
        return compact[p]
    extra = [token] + ([] if other is None else other.ids.tolist())
    k = other.k if other is not None else 20
    return compact_row(side[p], k=min(k, side[p].size), extra=extra, fingerprint=0)  # compared, not stored


def _kept(c: CompactRow) -> tuple[dict[int, float], str]:
    """A compact row's logits by id and the grid the full path would judge its row on."""
    vals = {int(t): float(v) for t, v in zip(c.ids, c.logits)}
    return vals, "bfloat16" if c.dtype == "bfloat16" else row_dtype(np.asarray(c.logits, np.float32))


def _full_metrics(store: Store, ref: Run, cand: Run,
                  tokens: Sequence[int], noise_positions: Collection[int] | None = None,
                  rule: TieRule = DEFAULT_RULE, own_top1: dict[int, int] | None = None,
                  ) -> tuple[PositionMetrics, list[int], bool, list[FlipAttribution], list[int]]:
    """Metrics of the positions with a row on both sides. Where both rows are full they are exact;
    where either side holds only its compact form (reduced at the source: ``tv_compact``), they
    come from the two compact forms (:mod:`tensorverse.analysis.topk`: flips, ranks within the
    top k, margins exact; KL a lower bound): those positions are returned last."""
    n = len(tokens)
    _refuse_compacted(store, cand.turn_id)
    both = sorted(set(_row_positions(store, ref, n)) & set(_row_positions(store, cand, n)))
    if not both:
        raise AnalysisInputError("no position has a captured row on both sides", "missing")
    src = StoredRows(store)
    parts = []
    classes: list[FlipAttribution] = []
    order: list[int] = []
    sparse: list[int] = []
    for s in range(0, len(both), CHUNK):
        ps = both[s: s + CHUNK]
        rf, rc = _load_side(src, ref.id, ps)
        cf, cc = _load_side(src, cand.id, ps)
        if own_top1 is not None:
            if len({r.shape[-1] for r in cf.values()}) > 1:  # rows of different widths: no
                own_top1.clear()  # departure read here (the free comparison's own pass says why)
                own_top1 = None
            else:
                own_top1.update((p, _own_top1(cf, cc, p)) for p in ps)
        dense = [p for p in ps if p in rf and p in cf]
        mixed = [p for p in ps if p not in dense]
        if dense:
            r = _stack(ref.id, [rf[p] for p in dense])
            c = _stack(cand.id, [cf[p] for p in dense])
            if r.shape[1] != c.shape[1]:
                raise AnalysisInputError(
                    f"rows of {ref.backend} have {r.shape[1]} logits, rows of {cand.backend} "
                    f"{c.shape[1]}: different vocabularies cannot be compared", "vocabulary")
            m = position_metrics(r, c, [tokens[p] for p in dense])
            parts.append(m)
            order.extend(dense)
            noise = None if noise_positions is None else [p in noise_positions for p in dense]
            classes.extend(classify_forced(r, m.ref_top1, m.cand_top1, noise=noise, positions=dense, rule=rule))
        if mixed:
            pairs = []
            for p in mixed:
                rcp = _as_compact(rf, rc, p, cc.get(p), tokens[p])
                ccp = _as_compact(cf, cc, p, rcp if p in rc else None, tokens[p])
                if rcp.vocab != ccp.vocab:
                    raise AnalysisInputError(
                        f"rows of {ref.backend} have {rcp.vocab} logits, rows of {cand.backend} "
                        f"{ccp.vocab}: different vocabularies cannot be compared", "vocabulary")
                pairs.append((rcp, ccp))
            m = topk_position_metrics([a.logprobs() for a, _ in pairs], [b.logprobs() for _, b in pairs],
                                      [tokens[p] for p in mixed])
            assert m.rank_lower_bound is not None  # top-k metrics always say which ranks are bounds
            for i, p in enumerate(mixed):  # the forced token's rank under the candidate:
                if p in cf:  # exact from its full row (its compact form knows only some ids above)
                    m.rank[i] = int(np.count_nonzero(cf[p] > cf[p][tokens[p]]))
                elif m.rank[i] >= cc[p].k:  # its k kept ids are all above it: more may be
                    m.rank_lower_bound[i] = True
            parts.append(m)
            order.extend(mixed)
            sparse.extend(mixed)
            noise = None if noise_positions is None else [p in noise_positions for p in mixed]
            full_ref = [i for i, p in enumerate(mixed) if p in rf]
            if full_ref:
                sel = np.asarray(full_ref)
                classes.extend(classify_forced(_stack(ref.id, [rf[mixed[i]] for i in full_ref]), m.ref_top1[sel],
                                               m.cand_top1[sel], noise=None if noise is None else [noise[i] for i in full_ref],
                                               positions=[mixed[i] for i in full_ref], rule=rule))
            kept_ref = [i for i, p in enumerate(mixed) if p not in rf]
            if kept_ref:
                sel = np.asarray(kept_ref)
                classes.extend(classify_forced_sparse([_kept(pairs[i][0]) for i in kept_ref], m.ref_top1[sel],
                                                      m.cand_top1[sel], noise=None if noise is None else [noise[i] for i in kept_ref],
                                                      positions=[mixed[i] for i in kept_ref], rule=rule))
    m = _concat(parts)
    if sparse:  # back into position order
        idx = np.argsort(np.asarray(order), kind="stable")
        m = _take(m, idx)
        classes.sort(key=attrgetter("position"))  # a forced flip always has its position
    return m, both, len(both) < n, classes, sparse


def _stack(run_id: str, rows: list[np.ndarray]) -> np.ndarray:
    widths = {r.shape[-1] for r in rows}
    if len(widths) != 1:
        raise AnalysisInputError(f"run {run_id}: rows of different widths {sorted(widths)}", "shape")
    return np.stack(rows)


def _take(m: PositionMetrics, idx: np.ndarray) -> PositionMetrics:
    return PositionMetrics(
        top1_agree=m.top1_agree[idx], kl=m.kl[idx], delta_p=m.delta_p[idx], margin=m.margin[idx],
        rank=m.rank[idx], entropy=m.entropy[idx], ref_top1=m.ref_top1[idx], cand_top1=m.cand_top1[idx],
        tokens=m.tokens[idx], approximate=m.approximate,
        rank_lower_bound=None if m.rank_lower_bound is None else m.rank_lower_bound[idx])


def _columns(m: PositionMetrics) -> dict[str, list[Any]]:
    return {
        "top1_agree": m.top1_agree.tolist(),
        "kl": m.kl.tolist(),
        "delta_p": m.delta_p.tolist(),
        "margin": m.margin.tolist(),
        "rank": m.rank.tolist(),
        "entropy": m.entropy.tolist(),
        "ref_top1": m.ref_top1.tolist(),
        "cand_top1": m.cand_top1.tolist(),
        **({"rank_lower_bound": m.rank_lower_bound.tolist()}
           if m.rank_lower_bound is not None else {}),
    }


def _template_mismatch(*runs: Run | None) -> bool:
    return any(r is not None and (r.template or {}).get("status") == "template_mismatch" for r in runs)


def compare_forced(store: Store, cand: RunLike, ref: RunLike,
                   tokens: Sequence[int], *, pieces: Sequence[str | None] | None = None,
                   roles: Mapping[str, str] | None = None,
                   noise_positions: Collection[int] | None = None, noise_source: str | None = None,
                   rule: TieRule = DEFAULT_RULE, own_top1: dict[int, int] | None = None) -> ForcedComparison:
    """One forced-mode comparison (full rows when both runs have them, else top-k).

    ``noise_positions``: positions where the noise run flips (None: no noise run; then no flip
    is ``noise``); every flip is classified (:mod:`tensorverse.analysis.attribution`).
    ``own_top1``: filled, on the full-row path, with the candidate's own top-1 at each position
    it read (:func:`compare_runs` hands it to the same backend's free comparison, which would
    otherwise read the forced run's rows once more for its departure)."""
    roles = roles or {}
    cand, ref = records.run(cand), records.run(ref)
    n = len(tokens)
    role = roles.get(cand.backend, cand.role)
    ref_role = roles.get(ref.backend, ref.role)
    incomplete = False
    sparse: list[int] = []
    if _full(cand) and _full(ref):
        m, positions, incomplete, classes, sparse = _full_metrics(store, ref, cand, tokens, noise_positions, rule,
                                                                  own_top1)
        kind = "full"
    elif _has_topk(cand, n) and _has_topk(ref, n):
        ks = [x for x in (cand.k, ref.k) if x]  # the smaller k of the two; none known: no bound
        ref_top, cand_top = ref.top_logprobs or [], cand.top_logprobs or []  # _has_topk: n entries each
        m = topk_position_metrics(ref_top[:n], cand_top[:n], list(tokens), k=min(ks) if ks else None)
        positions = list(range(n))
        kind = "topk"
        flip_set = set(forced_flips(m))
        entries = [parse_top_logprobs(ref_top[p]) if p in flip_set else {} for p in positions]
        noise = None if noise_positions is None else [p in noise_positions for p in positions]
        classes = classify_forced_topk(entries, m.ref_top1, m.cand_top1, noise=noise, rule=rule)
    else:
        raise AnalysisInputError(
            f"{cand.backend} ({cand.capture}) and {ref.backend} ({ref.capture}) "
            "have neither full rows nor top-k logprobs for every position on both sides", "missing")
    regions = None
    if pieces is not None and len(pieces) == n:
        all_regions = tag_regions(list(pieces))
        regions = [all_regions[p] for p in positions]
    flips_local = forced_flips(m)
    flips = [positions[i] for i in flips_local]
    cls_at = {a.position: a.flip_class.value for a in classes}
    flip_classes = [cls_at[p] for p in flips]
    summary = summarize(m, regions)
    by_class = flips_by_class(flip_classes)
    if regions is not None:
        by_rc: dict[str, dict[str, int]] = {}
        for i in flips_local:
            c = by_rc.setdefault(regions[i], {})
            c[cls_at[positions[i]]] = c.get(cls_at[positions[i]], 0) + 1
        summary["flips_by_region_class"] = by_rc
    if summary.get("first_flip") is not None:
        summary["first_flip"] = flips[0]
    return ForcedComparison(
        run_id=cand.id, ref_run_id=ref.id, turn_id=cand.turn_id, backend=cand.backend,
        ref_backend=ref.backend, role=role, ref_role=ref_role,
        noise_floor=role == "secondary" and ref_role == "primary",
        template_mismatch=_template_mismatch(cand, ref), status="ok",
        kind=kind,
        approximate=kind != "full" or bool(sparse),
        compact_positions=sparse or None,
        n=len(positions),
        positions=positions if incomplete else None,
        incomplete=incomplete,
        summary=summary,
        flips=flips,
        flip_classes=flip_classes,
        flips_by_class=by_class,
        attribution={"rule": rule.as_dict(), "noise_source": noise_source,
                     "details": [a.as_dict() for a in classes[:256]]},
        first_flip=flips[0] if flips else None,
        flip_tokens=[{"position": positions[i], "token": int(m.tokens[i]),
                      "ref_top1": int(m.ref_top1[i]), "cand_top1": int(m.cand_top1[i]),
                      "region": regions[i] if regions else None,
                      "flip_class": cls_at[positions[i]]} for i in flips_local[:256]],
        metrics=_columns(m),
        regions=regions,
    )


def _forced_departure(forced: Run | None, tokens: Sequence[int], store: Store) -> int | None:
    """First position where a backend's forced run preferred another token than the primary's."""
    if forced is None or forced.status != "ok":
        return None
    n = len(tokens)
    if _full(forced) and store is not None:
        src = StoredRows(store)
        for s in range(0, n, CHUNK):
            ps = list(range(s, min(n, s + CHUNK)))
            try:
                full, compact = _load_side(src, forced.id, ps)
            except KeyError:
                break
            if full:
                _stack(forced.id, list(full.values()))  # rows of one width, or an input error
            for p in ps:
                if _own_top1(full, compact, p) != int(tokens[p]):
                    return p
        else:
            return None
    tl = forced.top_logprobs
    if isinstance(tl, list) and len(tl) >= n:
        for p in range(n):
            e = tl[p]
            if not e:
                return None
            if int(e[0][0]) != int(tokens[p]):
                return p
    return None


def compare_free(cand: RunLike, primary: RunLike, *,
                 forced: RunLike | None = None, store: Any = None,
                 roles: Mapping[str, str] | None = None,
                 noise_positions: Collection[int] = (), rule: TieRule = DEFAULT_RULE,
                 pieces: Sequence[str | None] | None = None,
                 forced_top1: Mapping[int, int] | None = None) -> FreeComparison:
    """One free-mode comparison with the primary's recorded output.

    Its flip (the divergence point, or differing tool calls on identical tokens) is classified:
    the tie rule on the primary's recorded top-k at that point, ``noise`` when a noise run flips
    or diverges there (``noise_positions``), ``parser`` when the primary's own parser check
    (``primary["parser_check"]``) found a mismatch. ``pieces``: the primary's output pieces (the
    region of the divergence; default the primary's own). ``forced_top1``: the forced run's own
    top-1 at every position, as its forced comparison read them (``compare_forced``'s
    ``own_top1``); without it (or with a gap) the forced run's rows are read again."""
    roles = roles or {}
    cand, primary = records.run(cand), records.run(primary)
    forced = records.run(forced) if forced is not None else None
    ref_tokens = list(primary.token_ids)
    cand_tokens = list(cand.token_ids)
    d = free_divergence(ref_tokens, cand_tokens)
    ref_x = extract_tool_calls(primary.text or "", openai_tool_calls=primary.tool_calls)
    cand_x = extract_tool_calls(cand.text or "")
    verdict = compare_tool_calls(ref_x, cand_x)
    forced_ok = forced is not None and forced.status == "ok"
    if not forced_ok:
        departure = None
    elif forced_top1 is not None and _full(forced) and all(p in forced_top1 for p in range(len(ref_tokens))):
        departure = next((p for p, t in enumerate(ref_tokens) if forced_top1[p] != int(t)), None)
    else:
        departure = _forced_departure(forced, ref_tokens, store)
    role = roles.get(cand.backend, cand.role)
    tops = primary.top_logprobs
    pair = None
    if d.kind == "token" and isinstance(tops, list) and d.position is not None and d.position < len(tops) \
            and tops[d.position]:
        try:
            pair = topk_pair(parse_top_logprobs(tops[d.position]), d.ref_token, d.cand_token)
        except AnalysisInputError:
            pair = None
    pc = primary.parser_check
    pcs = pieces if pieces is not None else primary.pieces
    flip = classify_free(position=d.position, ref_token=d.ref_token, cand_token=d.cand_token,
                         ref_logits=pair, noise_positions=noise_positions,
                         tool_calls_differ=not verdict.match,
                         primary_parser_mismatch=bool(pc and pc.get("mismatch")),
                         rule=rule)
    return FreeComparison(
        run_id=cand.id, ref_run_id=primary.id, turn_id=cand.turn_id, kind="tokens",
        backend=cand.backend, ref_backend=primary.backend, role=role, ref_role="primary",
        noise_floor=role == "secondary", approximate=False, status="ok",
        divergence=d.as_dict(),
        diverged=d.diverged,
        common_prefix=d.common_prefix,
        first_flip=d.position,
        region=region_at(pcs, d.position) if d.diverged and pcs else None,
        flip_class=flip.flip_class.value if flip is not None else None,
        flips_by_class=flips_by_class([flip]),
        attribution={"rule": rule.as_dict(), "flip": flip.as_dict() if flip is not None else None},
        tool_calls=verdict.to_dict(),
        verdict=verdict.verdict,
        ref_tool_calls=len(ref_x.calls),
        cand_tool_calls=len(cand_x.calls),
        forced_departure=departure,
        confirms_forced=(departure == d.position) if forced_ok else None,
        template_mismatch=_template_mismatch(cand),
        finish_reason=cand.finish_reason,
        ref_finish_reason=primary.finish_reason,
    )


def compare_runs(store: Store, runs: Iterable[RunLike], *,
                 roles: Mapping[str, str] | None = None, pieces: Sequence[str | None] | None = None,
                 store_results: bool = True,
                 backends: Collection[str] | None = None) -> list[Comparison]:
    """All comparisons of one turn's runs (see the module docstring); stored when asked.

    ``backends``: only the comparisons that involve these backends (as candidate, or as the
    reference or noise floor of others); None for all. The runner passes the backends it just
    ran, so a proxy that shadows a turn backend by backend does not redo the others' work."""
    latest = latest_runs(runs)
    roles = dict(roles or {})
    primary = next((r for (b, m), r in latest.items() if m == "recorded"), None)
    if primary is None:
        raise AnalysisInputError("the turn has no recorded primary run", "missing")
    _refuse_compacted(store, primary.turn_id)
    tokens = [int(t) for t in primary.token_ids]
    n = len(tokens)
    if pieces is None:
        pieces = primary.pieces
    forced = {b: r for (b, m), r in latest.items() if m == "forced"}
    free = {b: r for (b, m), r in latest.items() if m == "free"}
    ref = select_reference(list(forced.values()), roles)
    out: list[Comparison] = []
    floor_run = next((r for b, r in sorted(forced.items()) if r.status == "ok"
                      and roles.get(b, r.role) == "secondary"), None)
    pivots = {x.backend for x in (ref, floor_run) if x is not None}
    everything = backends is None or bool(pivots & set(backends))

    def wanted(b: str) -> bool:
        return everything or b in (backends or ())

    def failed(cls: type[Comparison], cand: Run, refrun: Run, e: Exception) -> Comparison:
        return cls(run_id=cand.id, ref_run_id=refrun.id, turn_id=cand.turn_id, backend=cand.backend,
                   ref_backend=refrun.backend, status="error", error=f"{type(e).__name__}: {e}")

    # The noise run: where the secondary (the primary's exact config) flips against the primary,
    # a candidate's flip is `noise`; the secondary's own flips are noise by definition.
    proles = {**roles, primary.backend: "primary"}
    noise_positions: set[int] | None = None
    noise_source = None
    floor_res: ForcedComparison | Exception | None = None
    if floor_run is not None and n and len(floor_run.token_ids) >= n \
            and _has_topk(primary, n) and _has_topk(floor_run, n):
        try:
            # its flips only: where the noise run flips (regions and roles change no flip)
            noise_positions = set(compare_forced(store, floor_run, primary, tokens).flips or ())
            noise_source = f"secondary:{floor_run.backend}"
            floor_res = compare_forced(store, floor_run, primary, tokens, pieces=pieces, roles=proles,
                                       noise_positions=noise_positions, noise_source=noise_source)
        except (AnalysisInputError, KeyError, ValueError) as e:
            floor_res = e

    vs_primary: dict[str, ForcedComparison] = {}
    forced_top1: dict[str, dict[int, int]] = {}  # backend -> its forced run's own top-1 by position
    for b, run in sorted(forced.items()):
        if run.status != "ok" or len(run.token_ids) < n:
            continue
        if ref is not None and b != ref.backend and wanted(b):
            try:
                out.append(compare_forced(store, run, ref, tokens, pieces=pieces, roles=roles,
                                          noise_positions=noise_positions, noise_source=noise_source,
                                          own_top1=forced_top1.setdefault(b, {})))
            except (AnalysisInputError, KeyError, ValueError) as e:
                out.append(failed(ForcedComparison, run, ref, e))
        is_floor = floor_run is not None and b == floor_run.backend
        if n and (wanted(b) or is_floor) and _has_topk(primary, n) and _has_topk(run, n):
            try:
                if is_floor and isinstance(floor_res, Exception):
                    raise floor_res
                res = floor_res if is_floor and isinstance(floor_res, ForcedComparison) else \
                    compare_forced(store, run, primary, tokens, pieces=pieces, roles=proles,
                                   noise_positions=noise_positions, noise_source=noise_source)
                vs_primary[b] = res
                if wanted(b):
                    out.append(res)
            except (AnalysisInputError, KeyError, ValueError) as e:
                if wanted(b):
                    out.append(failed(ForcedComparison, run, primary, e))

    floor = next((r for r in vs_primary.values() if r.noise_floor), None)
    if floor is not None:
        for res in vs_primary.values():
            if res is floor or res.status != "ok":
                continue
            try:
                res.noise = {**compare_flip_rates(len(res.flips or ()), res.n or 0, len(floor.flips or ()),
                                                  floor.n or 0).as_dict(), "floor_backend": floor.backend}
            except AnalysisInputError as e:
                res.noise = {"error": str(e)}
            try:
                res.excess = {**excess_flip_rate((res.flips_by_class or {})["runtime"], res.n or 0,
                                                 (floor.flips_by_class or {})["noise"], floor.n or 0).as_dict(),
                              "floor_backend": floor.backend}
            except (AnalysisInputError, KeyError) as e:
                res.excess = {"error": str(e)}

    free_noise: set[int] = set(noise_positions or ())
    sec_free = free.get(floor_run.backend) if floor_run is not None else None
    if sec_free is not None and sec_free.status == "ok":
        pos = free_divergence(tokens, list(sec_free.token_ids)).position
        if pos is not None:
            free_noise.add(pos)

    for b, run in sorted(free.items()):
        if run.status != "ok" or not wanted(b):
            continue
        try:
            out.append(compare_free(run, primary, forced=forced.get(b), store=store, roles=roles,
                                    noise_positions=free_noise, pieces=pieces, forced_top1=forced_top1.get(b)))
        except (AnalysisInputError, KeyError, ValueError) as e:
            out.append(failed(FreeComparison, run, primary, e))

    if store_results:
        put_comparisons(store, out)
    return out


def put_comparisons(store: Store, results: Sequence[Comparison]) -> None:
    """Store the comparisons :func:`compare_runs` returned (waits for the writer)."""
    futures = [store.put_comparison(r.run_id, r.ref_run_id, r) for r in results]
    for f in futures:
        f.result()


def compare_turn(store: Store, turn_id: str, *, roles: Mapping[str, str] | None = None,
                 store_results: bool = True,
                 backends: Collection[str] | None = None) -> list[Comparison]:
    """Compare the stored runs of one turn and store the comparisons. Pure numpy on stored rows;
    blocking (call it in a thread from async code). ``backends``: see :func:`compare_runs`."""
    return compare_runs(store, list(store.iter_runs(turn_id)), roles=roles,
                        store_results=store_results, backends=backends)
