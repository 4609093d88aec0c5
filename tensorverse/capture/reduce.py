"""Evidence chosen where the logits are: a captured row reduced to its compact form at the source,
and sent in full only when it is evidence.

A request that opts in with ``tv_compact`` (:mod:`tensorverse.capture.optin`) has each captured
row reduced before it leaves the vLLM process:

* :func:`reduce_rows` (torch ops, on whatever device holds the rows, batched): per row the
  ``k + window`` highest logits with their ids, the float64 log-sum-exp, and whether the row is
  finite;
* :func:`decide` (host, per row): the evidence decision, then either "send the full row" with its
  reason or the row's :class:`~tensorverse.store.compact.CompactRow` (the store's compact form:
  the top ``k`` in the store's order and the log-sum-exp).

A row is sent in full, with its reason, when:

``requested``
    the proxy named its position (``tv_full``: the primary's tool-call regions, the primary's
    own close calls, the seeded sample);
``flip``
    a forced row whose top-1 is not the forced token: this runtime flips here, exactly (the
    top-1 is decided by the store's tie rule: the higher logit, then the lower id);
``close``
    the row's own top-2 gap is below ``close_nats``: a likely flip somewhere;
``ties``
    entries tied with the ``k``-th logit (or, for a forced row, the top-1) reach past the window,
    so the top ``k`` in the store's order is not known from the window alone (rare: exactly equal
    logits);
``nonfinite``
    the row holds NaN or infinity.

A forced row that travels compact has the forced token as its top-1, so the compact form needs no
extra ids: it is what compaction makes of the full row (whose extras, the run's and the primary's
token, are that same top-1). A free row's compact form lacks compaction's extra of the primary's
token at that position when it is outside the top ``k`` (the source does not know it; free rows
are compared by their tokens, not their logits).

Everything else travels as its compact form: about 180 bytes at ``k = 20`` against ~204 KB for a
full Qwen3 row. The compact form holds the same ids and float32 logits, in the same order, as
:func:`tensorverse.store.compact.compact_row` of the full row (the proxy's compaction), and the
same fingerprint (the full row's codec crc32); its log-sum-exp comes from ``torch.logsumexp`` in
float64 and may differ from the store's numpy sum in the last bits (a relative difference below
1e-13 is checked in the tests). Flips, margins, ranks within the top ``k`` and flip classes do not
depend on it.

Where the reduction runs: by default on the tap's encoder thread, over the host copy of the row
(the same copy full capture makes). With ``TENSORVERSE_CAPTURE_REDUCE=device`` the tap keeps the
row on the engine's device and reduces each step's rows there in one batch
(:func:`reduce_on_device`), so that only the small results cross to the host, and a whole row
only when it is evidence (:mod:`tensorverse.capture.tap`, docs/capture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tensorverse.capture.optin import EvidenceSpec
from tensorverse.store.compact import CompactRow

__all__ = ["Reduced", "OnDevice", "Decision", "reduce_on_device", "to_reduced", "reduce_rows", "decide", "REASONS",
           "WINDOW"]

#: why a row is sent in full (see the module docstring)
REASONS = ("requested", "flip", "close", "ties", "nonfinite")

#: entries beyond ``k`` read to order ties at the k-th logit exactly
WINDOW = 8


@dataclass(frozen=True, slots=True)
class Reduced:
    """What :func:`reduce_rows` computed for a batch of rows (host numpy arrays, row-major)."""

    vals: np.ndarray  # (B, w) float32: the w highest logits, descending (ties in any order)
    ids: np.ndarray  # (B, w) int64: their token ids
    lse: np.ndarray  # (B,) float64: log-sum-exp of the row
    finite: np.ndarray  # (B,) bool: every entry of the row is finite
    vocab: int


class Decision(NamedTuple):
    """``reason`` None: send ``compact``; else send the full row, for that reason."""

    reason: str | None
    compact: CompactRow | None


class OnDevice(NamedTuple):
    """What :func:`reduce_on_device` computed, still on the rows' device (no copy, no sync):
    the fields of :class:`Reduced` as tensors."""

    vals: torch.Tensor
    ids: torch.Tensor
    lse: torch.Tensor
    finite: torch.Tensor


def reduce_on_device(rows: torch.Tensor, k: int, *, window: int = WINDOW) -> OnDevice:
    """Reduce a (B, V) or (V,) batch of logits rows with torch ops on their own device, batched:
    no copy to the host and no synchronisation (the caller copies the small results)."""
    if rows.dim() == 1:
        rows = rows.unsqueeze(0)
    w = min(rows.shape[1], int(k) + int(window))
    x = rows if rows.dtype == torch.float32 else rows.float()
    vals, ids = torch.topk(x, w, dim=-1, sorted=True)
    lse = torch.logsumexp(x.double(), dim=-1)
    finite = torch.isfinite(vals[:, 0]) & torch.isfinite(x.amin(dim=-1)) & torch.isfinite(lse)
    return OnDevice(vals, ids, lse, finite)


def to_reduced(d: OnDevice, vocab: int) -> Reduced:
    """:class:`Reduced` from :func:`reduce_on_device`'s tensors (host tensors are only viewed;
    device tensors are copied, a blocking copy)."""
    return Reduced(d.vals.cpu().numpy(), d.ids.cpu().numpy().astype(np.int64, copy=False), d.lse.cpu().numpy(),
                   d.finite.cpu().numpy(), int(vocab))


def reduce_rows(rows: torch.Tensor, k: int, *, window: int = WINDOW) -> Reduced:
    """Reduce a (B, V) or (V,) batch of logits rows on their own device; one copy of the small
    results to the host."""
    return to_reduced(reduce_on_device(rows, k, window=window), rows.shape[-1])


def decide(r: Reduced, i: int, spec: EvidenceSpec, *, dtype: str, fingerprint: int) -> Decision:
    """The evidence decision for row ``i`` of ``r`` (see the module docstring). ``dtype``: the
    row's dtype as the store names it; ``fingerprint``: the full row's codec crc32."""
    if spec.requested:
        return Decision("requested", None)
    if not r.finite[i]:
        return Decision("nonfinite", None)
    k = min(int(spec.k), r.vocab)  # as compaction: at most the whole row
    vals, ids = r.vals[i], r.ids[i]
    order = np.lexsort((ids, -vals))  # value descending, then id ascending: the store's order
    vals, ids = vals[order], ids[order]
    w = vals.shape[0]
    if k > w:
        raise ValueError(f"k={k} exceeds the reduced window of {w}")
    # entries equal to a window value past the window may exist only at its last value
    cut = w < r.vocab
    top1_known = not cut or vals[0] > vals[w - 1]
    if spec.forced >= 0:
        if not top1_known:
            return Decision("ties", None)
        if int(ids[0]) != spec.forced:
            return Decision("flip", None)
    if w >= 2 and float(vals[0]) - float(vals[1]) < spec.close_nats:
        return Decision("close", None)
    if cut and vals[w - 1] == vals[k - 1]:
        return Decision("ties", None)
    return Decision(None, CompactRow(vocab=r.vocab, dtype=dtype, fingerprint=int(fingerprint),
                                     lse=float(r.lse[i]), k=k, ids=ids[:k].astype(np.int32),
                                     logits=vals[:k].astype(np.float32)))
