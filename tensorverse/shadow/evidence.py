"""What the proxy asks of a shadow's capture plugin when evidence is chosen at the source.

With ``[capture] logits = "evidence"`` each shadow run asks the plugin to reduce its rows where
they are captured (``tv_compact``; :mod:`tensorverse.capture.reduce` decides per row) and names
the positions it wants in full whatever the row holds (``tv_full``), so that both sides of a
likely flip are kept in every forced run of the turn, not only in the run that flips
(:func:`requested_positions`):

* the **tool-call regions** of the primary's answer (``tool_name``, ``tool_args``,
  ``tool_syntax``: the design's "every logit during tool calls"), when its pieces are known;
* the primary's own **close calls**: positions where its recorded top-k logprobs put the top two
  less than ``close_nats`` apart (a flip is most likely there, in any runtime), the closest first,
  at most ``close_share`` of the positions (compaction's rule: a flat model would otherwise keep
  most of its rows);
* the **seeded sample** of ``[retention] sample`` (the same positions compaction keeps for
  re-analysis: :func:`tensorverse.store.compaction.sampled`).

A **free** run is asked for the seeded sample only (:func:`free_requested_positions`, over the
positions it may generate), not for the primary's tool-call regions and close calls. Up to its
divergence a free run decodes the primary's prefix, as the same backend's forced run does, so its
row at a primary's position is that forced row again (the forced run keeps it); after the
divergence the position belongs to another text, where the primary's close calls and tool calls
mean nothing. The free comparison reads tokens, tool calls, the primary's recorded top-k and the
forced run's top-1s, never a free run's rows. Asking free runs for the primary's positions too
doubled the requested rows on the wire (``benchmarks/production_load.py``, ``benchmarks/RESULTS.md``).

Each run keeps in full, by itself, its own flips (a forced row whose top-1 is not the primary's
token) and its own close calls, below ``tv_close`` = :func:`close_threshold`: ``close_nats``, or
lower where more than ``close_share`` of the primary's own positions are under it (the gap of the
closest position left out), so that the runs, whose rows are near the primary's, keep about that
share too: the source cannot cap a share of rows it has not seen yet. What is not kept: the reference's row at a position where only
the candidate flips and neither the primary nor the reference saw a close call; there the
comparison has the reference's compact form (its top k and log-sum-exp), which gives the flip and
its class exactly and its margin whenever the candidate's token is in the reference's top k.

:func:`requested_positions` and :func:`close_threshold` are pure; :func:`xargs` is what goes into
``vllm_xargs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tensorverse.analysis.regions import tag_regions
from tensorverse.capture.optin import KEY_CLOSE, KEY_COMPACT, KEY_FULL
from tensorverse.shadow.turn import TurnInput
from tensorverse.store.compaction import sampled

__all__ = ["SourceEvidence", "requested_positions", "free_requested_positions", "close_threshold", "xargs",
           "TOOL_REGIONS"]

TOOL_REGIONS = frozenset({"tool_name", "tool_args", "tool_syntax"})


@dataclass(frozen=True)
class SourceEvidence:
    """The evidence policy applied at the source (``[retention]``'s values)."""

    k: int = 20  # logits of a compact row
    close_nats: float = 0.1  # a top-2 gap below this is a close call...
    close_share: float = 0.02  # ...the closest first, at most this share of the positions
    sample: float = 0.005  # share of positions kept in full for re-analysis
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 4096:
            raise ValueError("k must be in 1..4096")
        if not self.close_nats >= 0 or not 0.0 <= self.sample <= 1.0 or not 0.0 <= self.close_share <= 1.0:
            raise ValueError("close_nats must be >= 0, sample and close_share in [0, 1]")


def _gap(entry: Sequence[Sequence[float]] | None) -> float | None:
    """The top-2 gap (nats) of a normalized top-k entry (``[[id, logprob], ...]``), if it has two."""
    if not entry or len(entry) < 2:
        return None
    lps = sorted((float(e[1]) for e in entry), reverse=True)
    return lps[0] - lps[1]


def _primary_gaps(turn: TurnInput) -> dict[int, float]:
    n = len(turn.output_token_ids)
    gaps = {p: _gap(e) for p, e in enumerate((turn.top_logprobs or [])[:n])}
    return {p: g for p, g in gaps.items() if g is not None}


def _cap(turn: TurnInput, ev: SourceEvidence) -> int:
    """Close calls kept of a turn: ``close_share`` of its positions, at least one (none at 0)."""
    return max(1, int(ev.close_share * len(turn.output_token_ids))) if ev.close_share > 0 else 0


def _closest(turn: TurnInput, ev: SourceEvidence) -> list[int]:
    """The primary's close calls: gap under ``close_nats``, the closest first, at most
    ``close_share`` of the positions (at least one)."""
    under = sorted(((g, p) for p, g in _primary_gaps(turn).items() if g < ev.close_nats))
    return [p for _, p in under[:_cap(turn, ev)]]


def close_threshold(turn: TurnInput, ev: SourceEvidence) -> float:
    """``tv_close`` for the runs of ``turn`` (see the module docstring): ``close_nats``, or the
    gap of the primary's closest position beyond its ``close_share`` when more are under it."""
    cap = _cap(turn, ev)
    under = sorted(g for g in _primary_gaps(turn).values() if g < ev.close_nats)
    return ev.close_nats if len(under) <= cap else float(under[cap])


def requested_positions(turn: TurnInput, ev: SourceEvidence, pieces: Sequence[str] | None = None) -> list[int]:
    """The output positions whose rows every run of ``turn`` sends in full (sorted)."""
    n = len(turn.output_token_ids)
    want: set[int] = set()
    pieces = pieces if pieces is not None else turn.pieces
    if pieces is not None and len(pieces) == n:
        want.update(p for p, r in enumerate(tag_regions(list(pieces))) if r in TOOL_REGIONS)
    want.update(_closest(turn, ev))
    want.update(p for p in range(n) if sampled(ev.seed, turn.id, p, ev.sample))
    return sorted(want)


def free_requested_positions(turn: TurnInput, ev: SourceEvidence, length: int) -> list[int]:
    """The positions a free run of ``turn`` sends in full whatever its rows hold: the seeded
    sample of its first ``length`` positions (its ``max_tokens``; compaction samples a free run's
    positions with the same hash), nothing of the primary's (see the module docstring)."""
    return [p for p in range(max(0, int(length))) if sampled(ev.seed, turn.id, p, ev.sample)]


def _ranges(ps: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2,5,7-8"`` (what ``tv_full`` reads, shorter than a list)."""
    out: list[str] = []
    i = 0
    while i < len(ps):
        j = i
        while j + 1 < len(ps) and ps[j + 1] == ps[j] + 1:
            j += 1
        out.append(str(ps[i]) if i == j else f"{ps[i]}-{ps[j]}")
        i = j + 1
    return ",".join(out)


def xargs(ev: SourceEvidence, full: Sequence[int], close: float | None = None) -> dict[str, Any]:
    """The ``vllm_xargs`` keys of a run that asks for evidence at the source (``close``: its
    ``tv_close``, :func:`close_threshold`; default ``close_nats``)."""
    out: dict[str, Any] = {KEY_COMPACT: ev.k, KEY_CLOSE: ev.close_nats if close is None else close}
    if full:
        out[KEY_FULL] = _ranges(sorted(set(full)))
    return out
