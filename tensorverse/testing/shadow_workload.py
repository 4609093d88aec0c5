"""A shadowed turn written straight into a store, as the proxy and the capture plugin write it.

For the compaction benchmark (``benchmarks/store_growth.py``) and its tests: no vLLM, the store's
real write path (records, codec blobs), the real comparisons (`tensorverse.shadow.compare`).
The line-up is three shadows, each run forced and free:

* ``secondary`` (role ``secondary``: the primary's exact config, the reference of the forced
  comparisons and the noise floor): its rows are the reference rows;
* ``twin`` (a shadow bit-identical to the secondary, as another replica of the same config is):
  the same rows bit for bit;
* ``candidate``: the near-identical shadow rows (``shadow``), with the top two logits swapped
  at ``flip_share`` of the positions (a flip); its free run follows the primary's tokens to its
  first flip, then goes its own way on rows of other contexts.

The primary's recorded run holds the tokens (the reference rows' argmax) and their top-5
logprobs, as the proxy records them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorverse.shadow.compare import compare_turn
from tensorverse.shadow.runs import primary_run_id
from tensorverse.store.codec import encode_row
from tensorverse.store.records import Comparison, Run, Session, Turn

__all__ = ["ShadowedTurn", "PreparedTurn", "prepare_turn", "store_turn", "write_turn", "LINEUP"]

LINEUP = (("secondary", "secondary"), ("twin", "shadow"), ("candidate", "shadow"))


@dataclass(frozen=True)
class ShadowedTurn:
    turn_id: str
    session_id: str
    tokens: list[int]
    flips: list[int]  # the candidate's forced flip positions
    run_ids: dict[tuple[str, str], str]  # (backend, mode) -> run id
    comparisons: list[Comparison]


def _top5(x: np.ndarray) -> list[list[list[float]]]:
    out = []
    for row in x.astype(np.float64):
        lp = row - row.max()
        lp -= np.log(np.exp(lp).sum())
        order = np.argsort(-lp, kind="stable")[:5]
        out.append([[int(i), float(lp[i])] for i in order])
    return out


@dataclass(frozen=True)
class PreparedTurn:
    """What the primary and the shadows' engines hand the proxy for one shadowed turn: the
    primary's tokens and top-5, and per (backend, mode) the run's tokens, its top-5 (forced runs)
    and its rows already encoded (the capture plugin encodes them in the engine's process)."""

    turn_id: str
    session_id: str
    index: int
    created_ns: int
    tokens: list[int]
    flips: list[int]
    primary_top5: list[list[list[float]]]
    runs: dict[tuple[str, str], tuple[list[int], list[list[list[float]]] | None, list[tuple[int, bytes]]]]


def prepare_turn(turn_id: str, session_id: str, index: int, ref: np.ndarray, shadow: np.ndarray, other: np.ndarray,
                 *, flip_share: float, seed: int, created_ns: int, evidence: Any = None) -> PreparedTurn:
    """The engines' and the primary's side of one shadowed turn (see the module docstring):
    ``ref``, ``shadow`` and ``other`` are (n, vocab) float32 rows: the reference's, a
    near-identical runtime's, and rows of other contexts (the candidate's free run after it
    diverged). Nothing here is the proxy's work. ``evidence``: a
    `tensorverse.shadow.evidence.SourceEvidence`: each row is reduced as the capture plugin
    reduces it with ``tv_compact`` (the proxy's ``tv_full`` from the primary's top-5 and the
    sample), so non-evidence rows are compact blobs (rows ``(position, blob, None, compact)``)."""
    rng = np.random.default_rng(seed)
    n = ref.shape[0]
    tokens = [int(t) for t in np.argmax(ref, axis=1)]
    cand = shadow.copy()
    k = int(round(flip_share * n))
    flips = sorted(int(p) for p in rng.choice(n, size=k, replace=False)) if k else []
    for p in flips:
        order = np.argsort(-cand[p], kind="stable")
        a, b = int(order[0]), int(order[1])
        if a != tokens[p]:  # already flipped by the perturbation
            continue
        cand[p, a], cand[p, b] = cand[p, b], cand[p, a]
    cand_top = np.argmax(cand, axis=1)
    real_flips = [p for p in range(n) if int(cand_top[p]) != tokens[p]]
    first = real_flips[0] if real_flips else None
    free_rows = cand.copy()
    free_tokens = list(tokens)
    if first is not None:
        free_tokens[first] = int(cand_top[first])
        free_rows[first + 1:] = other[first + 1:]
        free_tokens[first + 1:] = [int(t) for t in np.argmax(other[first + 1:], axis=1)]
    rows_of = {("secondary", "forced"): (ref, tokens), ("secondary", "free"): (ref, tokens),
               ("twin", "forced"): (ref, tokens), ("twin", "free"): (ref, tokens),
               ("candidate", "forced"): (cand, tokens), ("candidate", "free"): (free_rows, free_tokens)}
    runs = {}
    primary_top5 = _top5(ref)
    full: dict[str, set[int]] = {"forced": set(), "free": set()}
    close = 0.0
    if evidence is not None:
        from tensorverse.shadow.evidence import close_threshold, free_requested_positions, requested_positions
        from tensorverse.shadow.turn import TurnInput

        ti = TurnInput(id=turn_id, prompt_token_ids=[0], output_token_ids=tokens, top_logprobs=list(primary_top5))
        full = {"forced": set(requested_positions(ti, evidence)), "free": set(free_requested_positions(ti, evidence, n))}
        close = close_threshold(ti, evidence)
    for backend, _role in LINEUP:
        for mode in ("forced", "free"):
            x, toks = rows_of[(backend, mode)]
            if evidence is None:
                blobs: list[tuple] = [(p, encode_row(x[p])) for p in range(n)]
            else:
                blobs = []
                for p in range(n):
                    blob, compact = _at_source(x[p], evidence, close, tokens[p] if mode == "forced" else -1,
                                               p in full[mode])
                    blobs.append((p, blob, None, compact))
            runs[(backend, mode)] = (toks, _top5(x) if mode == "forced" else None, blobs)
    return PreparedTurn(turn_id, session_id, index, created_ns, tokens, real_flips, primary_top5, runs)


def _at_source(row: np.ndarray, evidence: Any, close: float, forced: int, requested: bool) -> tuple[bytes, bool]:
    """One float32 row as the capture plugin sends it with ``tv_compact``: (blob, compact)."""
    import torch

    from tensorverse.capture.optin import EvidenceSpec
    from tensorverse.capture.reduce import decide, reduce_rows
    from tensorverse.store.codec import row_checksum
    from tensorverse.store.compact import encode_compact

    spec = EvidenceSpec(evidence.k, close, forced, requested)
    d = decide(reduce_rows(torch.from_numpy(row), evidence.k), 0, spec, dtype="float32",
               fingerprint=row_checksum(row))
    return (encode_row(row), False) if d.compact is None else (encode_compact(d.compact), True)


def store_turn(store: Any, t: PreparedTurn, *, compare: bool = True) -> ShadowedTurn:
    """The proxy's side of one shadowed turn: the records and the rows written through the
    store's real write path, then the real comparisons (what ``proxy_cpu`` figures measure;
    ``compare=False``: none, the turn is left as the shadow runs leave it)."""
    store.put_session(Session(id=t.session_id, created_ns=t.created_ns, tags={"agent": "workload"})).result()
    store.put_turn(Turn(id=t.turn_id, session_id=t.session_id, index=t.index, created_ns=t.created_ns,
                        endpoint="completions", backend="primary", state="ok", output_token_ids=t.tokens)).result()
    runs: dict[tuple[str, str], str] = {}
    store.put_run(Run(id=primary_run_id(t.turn_id), turn_id=t.turn_id, session_id=t.session_id, backend="primary",
                      role="primary", mode="recorded", capture="topk", approximate=True, token_ids=t.tokens,
                      top_logprobs=t.primary_top5, k=5, text="", created_ns=t.created_ns)).result()
    n = len(t.tokens)
    complete = {"expected": n, "present": n, "complete": True}
    for backend, role in LINEUP:
        for mode in ("forced", "free"):
            toks, top, blobs = t.runs[(backend, mode)]
            rid = f"{t.turn_id}.{backend}.{mode}"
            runs[(backend, mode)] = rid
            store.put_run(Run(id=rid, turn_id=t.turn_id, session_id=t.session_id, backend=backend, role=role,
                              mode=mode, status="ok", capture="full", token_ids=toks, top_logprobs=top, k=5,
                              rows=complete, text="", created_ns=t.created_ns)).result()
            store.write_rows(rid, blobs).result()
    comparisons = compare_turn(store, t.turn_id, roles={b: r for b, r in LINEUP}) if compare else []
    return ShadowedTurn(t.turn_id, t.session_id, t.tokens, t.flips, runs, comparisons)


def write_turn(store: Any, turn_id: str, session_id: str, index: int, ref: np.ndarray, shadow: np.ndarray,
               other: np.ndarray, *, flip_share: float, seed: int, created_ns: int) -> ShadowedTurn:
    """One shadowed turn prepared (:func:`prepare_turn`) and stored (:func:`store_turn`)."""
    return store_turn(store, prepare_turn(turn_id, session_id, index, ref, shadow, other, flip_share=flip_share,
                                          seed=seed, created_ns=created_ns))
