"""Reading a run's rows whatever compaction left of them: full, delta, or compact.

:class:`StoredRows` answers, for (run, position): the full row (decoded through its delta
reference when compaction re-encoded it as a delta: the ``compacted`` record of its turn names
the reference run), or the compact row (`tensorverse.store.compact`) when compaction replaced it,
or neither (never captured). Asking for the full row of a compacted position raises
:class:`RowCompacted` (:class:`RowPruned` where retention deleted the session's rows), which is
not a ``KeyError``: such a row is not missing data, and code that skips missing rows must not skip
it silently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tensorverse.store import RecordNotFound
from tensorverse.store.codec import CodecError, blob_info, decode_row
from tensorverse.store.compact import CompactRow, decode_compact
from tensorverse.store.records import Compaction

if TYPE_CHECKING:
    from tensorverse.store.store import Store

__all__ = ["StoredRows", "RowCompacted", "RowPruned"]


class RowCompacted(LookupError):
    """The full row of this position was replaced by its compact form; ``compact`` holds it."""

    def __init__(self, run_id: str, position: int, compact: CompactRow | None = None) -> None:
        super().__init__(f"row {position} of run {run_id} was compacted (its top-{compact.k if compact else '?'} "
                         "logits are kept; the stored comparisons were computed from the full row)")
        self.run_id = run_id
        self.position = position
        self.compact = compact


class RowPruned(RowCompacted):
    """Retention deleted this session's rows (its records and comparisons are kept)."""

    def __init__(self, run_id: str, position: int) -> None:
        LookupError.__init__(self, f"row {position} of run {run_id} was pruned by [retention] (the session's "
                             "records and stored comparisons are kept)")
        self.run_id = run_id
        self.position = position
        self.compact = None


class StoredRows:
    """See the module docstring. Caches each run's turn and compaction record."""

    _MAX_DEPTH = 4  # delta chains: a free row -> its backend's forced row -> the reference's row

    def __init__(self, store: Store) -> None:
        self.store = store
        self._compaction: dict[str, Compaction | None] = {}

    def compaction_of(self, run_id: str) -> Compaction | None:
        """The compaction record of the run's turn (None: not compacted)."""
        if run_id not in self._compaction:
            rec = None
            if hasattr(self.store, "compaction"):
                try:
                    rec = self.store.compaction(self.store.get_run(run_id).turn_id)
                except (KeyError, ValueError):
                    rec = None
            self._compaction[run_id] = rec
        return self._compaction[run_id]

    def pruned(self, run_id: str) -> bool:
        """Whether retention deleted the rows of the run's session."""
        rec = self.compaction_of(run_id)
        return rec is not None and bool(rec.rows_pruned)

    def delta_ref(self, run_id: str) -> str | None:
        rec = self.compaction_of(run_id)
        run = rec.runs.get(run_id) if rec is not None else None
        return run.delta_ref if run is not None else None

    def compact(self, run_id: str, position: int) -> CompactRow | None:
        reader = getattr(self.store, "read_compact_row", None)
        blob = reader(run_id, position) if reader is not None else None
        return None if blob is None else decode_compact(blob, record=f"{run_id}@{position}")

    def form(self, run_id: str, position: int) -> str | None:
        """``full``, ``compact`` or None (no row)."""
        try:
            self.store.read_row(run_id, position)
            return "full"
        except KeyError:
            return "compact" if self.compact(run_id, position) is not None else None

    def row(self, run_id: str, position: int, _depth: int = 0) -> np.ndarray:
        """The full row as the codec returns it (float32, float16, or bfloat16 bits), bit-exact.
        Raises :class:`RowCompacted` for a compacted position, ``RecordNotFound`` for none."""
        try:
            blob = self.store.read_row(run_id, position)
        except KeyError:
            c = self.compact(run_id, position)
            if c is not None:
                raise RowCompacted(run_id, position, c) from None
            if self.pruned(run_id):
                raise RowPruned(run_id, position) from None
            raise
        return self.decode(run_id, position, blob, _depth)

    def decode(self, run_id: str, position: int, blob: bytes, _depth: int = 0) -> np.ndarray:
        """Decode a row blob already read from the store (through its delta reference)."""
        record = f"{run_id}@{position}"
        try:
            return decode_row(blob, record=record)
        except CodecError:
            if not blob_info(blob, record=record)["needs_ref"]:  # really bad, not a delta
                raise
        ref = self.delta_ref(run_id)
        if ref is None or _depth >= self._MAX_DEPTH:
            raise RecordNotFound(f"row {position} of run {run_id} is a delta and its turn names no reference run")
        return decode_row(blob, ref=self.row(ref, position, _depth + 1), record=record)
