"""A position's distribution, and the reader that decodes a turn's stored logits rows.

A distribution is either a full-vocabulary logits row (:class:`Row`, decoded from the store by
:class:`RowReader`) or the top-k logprobs a run recorded (:class:`TopK`); both answer the same
questions (top tokens, logprobs, ranks), so panels and metrics take either.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from tensorverse.analysis.metrics import widen_bf16
from tensorverse.store import RecordNotFound
from tensorverse.store.codec import CodecError
from tensorverse.store.compact import CompactRow
from tensorverse.store.stored_rows import RowCompacted, StoredRows
from tensorverse.viz.lane import Lane

__all__ = ["Row", "TopK", "Compacted", "RowReader", "margin"]


class Row:
    """A full-vocabulary logits row; its log-normaliser (float64) is computed on first use."""

    __slots__ = ("x", "_lse")

    def __init__(self, x: np.ndarray) -> None:
        self.x = widen_bf16(np.asarray(x)).reshape(-1)
        self._lse: float | None = None

    @property
    def ok(self) -> bool:
        """No NaN or infinity in the row."""
        x = self.x
        return bool(x.size) and math.isfinite(float(x.max())) and math.isfinite(float(x.min()))

    @property
    def lse(self) -> float:
        if self._lse is None:
            x = self.x
            m = float(x.max()) if x.size else math.nan
            if math.isfinite(m) and math.isfinite(float(x.min())):
                # float32 exp, float64 sum: ample for probabilities shown to 4 digits
                self._lse = m + math.log(float(np.exp(x - np.float32(m)).sum(dtype=np.float64)))
            else:
                self._lse = math.nan
        return self._lse

    def top(self, k: int) -> list[int]:
        x = self.x
        k = min(k, x.size)
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.lexsort((idx, -x[idx]))]
        return idx.tolist()

    def logp(self, ids: Sequence[int]) -> list[float]:  # a full row knows every id
        v = self.x[np.asarray(ids, dtype=np.int64)].astype(np.float64) - self.lse
        return v.tolist()

    def rank(self, ids: Sequence[int]) -> list[int | None]:
        vals = self.x[np.asarray(ids, dtype=np.int64)]
        return (self.x[None, :] > vals[:, None]).sum(axis=1).tolist()

    def topk_dict(self, k: int) -> dict[int, float]:
        ids = self.top(k)
        return dict(zip(ids, self.logp(ids)))


class TopK:
    """A position's top-k logprobs from the API: ``{token id: logprob}``."""

    __slots__ = ("d", "_order")

    def __init__(self, d: dict[int, float]) -> None:
        self.d = d
        self._order = sorted(d, key=lambda t: (-d[t], t))

    @property
    def ok(self) -> bool:
        return bool(self.d)

    def top(self, k: int) -> list[int]:
        return self._order[:k]

    def logp(self, ids: Sequence[int]) -> list[float | None]:
        return [self.d.get(int(i)) for i in ids]

    def rank(self, ids: Sequence[int]) -> list[int | None]:
        out: list[int | None] = []
        for i in ids:
            v = self.d.get(int(i))
            out.append(None if v is None else sum(1 for w in self.d.values() if w > v))
        return out

    def topk_dict(self, k: int) -> dict[int, float]:
        return self.d


class Compacted(TopK):
    """A position whose full row compaction replaced (`tensorverse.store.compact`): its kept
    top-k logits as exact logprobs (the full row's log-sum-exp is kept), so the top-k panel,
    margins and ranks within the top-k are exact; metrics over the whole vocabulary are not
    (the stored comparison holds those, computed from the full row)."""

    __slots__ = ("row",)
    compacted = True

    def __init__(self, row: CompactRow) -> None:
        super().__init__(row.logprobs())
        self.row = row

    def top(self, k: int) -> list[int]:
        return self.row.top(k)

    def rank(self, ids: Sequence[int]) -> list[int | None]:
        return self.row.rank(ids)


def margin(d: Any) -> float | None:
    """The probability of a distribution's top token minus its second's (None: unknown)."""
    top = d.top(2)
    lp = d.logp(top)
    if len(lp) < 2 or lp[0] is None or lp[1] is None:
        return None
    return math.exp(lp[0]) - math.exp(lp[1])


class RowReader:
    """Decoded rows of a turn's runs, fetched position by position (a small LRU). Problems
    (an undecodable or non-finite row) are added to ``warnings``: each once, at most 50."""

    def __init__(self, store: Any, warnings: list[str], size: int = 32) -> None:
        self.store = store
        self.warnings = warnings
        self.size = size
        self._cache: OrderedDict[tuple[str, int], Row | Compacted | None] = OrderedDict()
        self._has: dict[str, bool] = {}
        self._lock = threading.Lock()
        self._src = StoredRows(store)

    def has_rows(self, lane: Lane | None) -> bool:
        """Whether the run stored rows (its record says so, checked at its first positions)."""
        if lane is None or not lane.run_id:
            return False
        rid = lane.run_id
        if rid not in self._has:
            if lane.capture in ("topk", "none") and not lane.positions:
                self._has[rid] = False
            else:
                probe = list(lane.positions or [])[:2] + list(range(min(4, max(1, len(lane.token_ids)))))
                self._has[rid] = any(self._blob(rid, p) is not None or self._compact(rid, p) is not None
                                     for p in probe)
            if not self._has[rid] and self._src.pruned(rid):
                self.warn(f"{lane.backend} ({lane.mode}): rows pruned by [retention]: its recorded top-k shown; "
                          "the stored comparisons hold the exact metrics")
        return self._has[rid]

    def _compact(self, rid: str, pos: int) -> CompactRow | None:
        try:
            return self._src.compact(rid, pos)
        except CodecError as exc:
            self.warn(f"run {rid}: {exc}")
            return None

    def _blob(self, rid: str, pos: int) -> bytes | None:
        try:
            return self.store.read_row(rid, pos)
        except (RecordNotFound, KeyError, ValueError):
            return None

    def get(self, lane: Lane, pos: int, ref: Lane | None = None) -> Row | Compacted | None:
        """The lane's row at ``pos``: a :class:`Row`, a :class:`Compacted` position (its full row
        was compacted: said once per lane in ``warnings``), or None. Deltas are decoded through
        the reference run their turn's compaction record names (``ref`` is not needed)."""
        rid = lane.run_id
        if rid is None or not self.has_rows(lane):
            return None
        key = (rid, pos)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        row: Row | Compacted | None = None
        try:
            row = Row(self._src.row(rid, pos))
            if not row.ok:
                self.warn(f"{lane.backend} ({lane.mode}): row {pos} holds NaN/inf; skipped")
                row = None
        except RowCompacted as exc:
            if exc.compact is None:  # pruned since this run was first looked at: nothing is left
                self.warn(f"{lane.backend} ({lane.mode}): rows pruned by [retention]: the stored comparisons "
                          "hold the exact metrics")
                row = None
            else:
                row = Compacted(exc.compact)
                self.warn(f"{lane.backend} ({lane.mode}): compacted positions show their kept top-{exc.compact.k} "
                          "logprobs (exact); whole-vocabulary metrics there are the stored comparison's")
        except (RecordNotFound, KeyError, ValueError) as exc:
            if isinstance(exc, CodecError):
                self.warn(f"{lane.backend} ({lane.mode}): {exc}")
            row = None
        with self._lock:
            self._cache[key] = row
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return row

    def warn(self, msg: str) -> None:
        if msg not in self.warnings and len(self.warnings) < 50:
            self.warnings.append(msg)

    def engine(self, lanes: Sequence[Lane | None], pos: int) -> list[dict | None]:
        """Per lane, the engine state stored with its row at ``pos``, for the top-k panel."""
        out: list[dict | None] = []
        for lane in lanes:
            st = None
            if lane is not None and lane.run_id and hasattr(self.store, "read_engine_state"):
                try:
                    st = self.store.read_engine_state(lane.run_id, pos)
                except Exception:  # noqa: BLE001 - a panel without it is still a panel
                    st = None
            out.append(None if st is None else {"b": st.batch_size, "s": st.step})
        return out
