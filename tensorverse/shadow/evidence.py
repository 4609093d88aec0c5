"""What the proxy asks of a shadow's capture plugin when evidence is chosen at the source.

With ``[capture] logits = "evidence"`` each shadow run asks the plugin to reduce its rows where
they are captured (``tv_compact``; :mod:`tensorverse.capture.reduce` decides per row) and names
the positions it wants in full whatever the row holds (``tv_full``), so that both sides of a
likely flip are kept in every run of the turn, not only in the run that flips:

* the **tool-call regions** of the primary's answer (``tool_name``, ``tool_args``,
  ``tool_syntax``: the design's "every logit during tool calls"), when its pieces are known;
* the primary's own **close calls**: positions where its recorded top-k logprobs put the top two
  less than ``close_nats`` apart (a flip is most likely there, in any runtime);
* the **seeded sample** of ``[retention] sample`` (the same positions compaction keeps for
  re-analysis: :func:`tensorverse.store.compaction.sampled`).

Each run keeps in full, by itself, its own flips (a forced row whose top-1 is not the primary's
token) and its own close calls. What is not kept: the reference's row at a position where only
the candidate flips and neither the primary nor the reference saw a close call; there the
comparison has the reference's compact form (its top k and log-sum-exp), which gives the flip and
its class exactly and its margin whenever the candidate's token is in the reference's top k.

:func:`requested_positions` is pure; :func:`xargs` is what goes into ``vllm_xargs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tensorverse.analysis.regions import tag_regions
from tensorverse.capture.optin import KEY_CLOSE, KEY_COMPACT, KEY_FULL
from tensorverse.shadow.turn import TurnInput
from tensorverse.store.compaction import sampled

__all__ = ["SourceEvidence", "requested_positions", "xargs", "TOOL_REGIONS"]

TOOL_REGIONS = frozenset({"tool_name", "tool_args", "tool_syntax"})


@dataclass(frozen=True)
class SourceEvidence:
    """The evidence policy applied at the source (``[retention]``'s values)."""

    k: int = 20  # logits of a compact row
    close_nats: float = 0.1  # a top-2 gap below this is a close call
    sample: float = 0.005  # share of positions kept in full for re-analysis
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 4096:
            raise ValueError("k must be in 1..4096")
        if not self.close_nats >= 0 or not 0.0 <= self.sample <= 1.0:
            raise ValueError("close_nats must be >= 0 and sample in [0, 1]")


def _close(entry: Sequence[Sequence[float]] | None, close_nats: float) -> bool:
    """Whether a normalized top-k entry (``[[id, logprob], ...]``, best first) is a close call."""
    if not entry or len(entry) < 2:
        return False
    lps = sorted((float(e[1]) for e in entry), reverse=True)
    return lps[0] - lps[1] < close_nats


def requested_positions(turn: TurnInput, ev: SourceEvidence, pieces: Sequence[str] | None = None) -> list[int]:
    """The output positions whose rows every run of ``turn`` sends in full (sorted)."""
    n = len(turn.output_token_ids)
    want: set[int] = set()
    pieces = pieces if pieces is not None else turn.pieces
    if pieces is not None and len(pieces) == n:
        want.update(p for p, r in enumerate(tag_regions(list(pieces))) if r in TOOL_REGIONS)
    for p, entry in enumerate((turn.top_logprobs or [])[:n]):
        if _close(entry, ev.close_nats):
            want.add(p)
    want.update(p for p in range(n) if sampled(ev.seed, turn.id, p, ev.sample))
    return sorted(want)


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


def xargs(ev: SourceEvidence, full: Sequence[int]) -> dict[str, Any]:
    """The ``vllm_xargs`` keys of a run that asks for evidence at the source."""
    out: dict[str, Any] = {KEY_COMPACT: ev.k, KEY_CLOSE: ev.close_nats}
    if full:
        out[KEY_FULL] = _ranges(sorted(set(full)))
    return out
