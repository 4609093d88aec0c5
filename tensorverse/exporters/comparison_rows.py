"""The rows of the ``comparisons`` table, typed: from a store, or read back from exports.

``tensorverse export`` writes one row per comparison (:func:`tensorverse.exporters.export.comparison_row`,
the columns of ``SCHEMA["comparisons"]``). :class:`ComparisonRow` is how readers see such a row;
:func:`from_store` builds the same rows from a store without writing files, :func:`read_tables`
reads them back from JSONL or Parquet exports: a file, a directory holding ``comparisons.jsonl``
or ``comparisons.parquet``, or many of either (a fleet's replicas, concatenated). JSON-valued
columns (``flips_by_class``...) are decoded here, once. The verdict reads these rows
(:mod:`tensorverse.analysis.verdict`); an export from before the verdict lacks its columns and is
refused with their names, never guessed at.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import msgspec
import orjson

from tensorverse.exporters.export import comparison_row
from tensorverse.store import records

if TYPE_CHECKING:
    from tensorverse.store import Store

__all__ = ["ComparisonRow", "StoreRows", "TableError", "from_store", "read_tables", "row_of", "REQUIRED"]

#: columns without which the verdict cannot be computed (exports older than issue 25 lack them)
REQUIRED = ("turn_created_ns", "ref_tool_calls", "cand_tool_calls", "flips_by_region_class", "positions_by_region")
_JSON_COLUMNS = ("flips_by_class", "flips_by_region_class", "positions_by_region")


class TableError(ValueError):
    """An unreadable or unsuitable exported table (the message names the file and the column)."""


class ComparisonRow(msgspec.Struct, kw_only=True):
    run_id: str | None = None
    ref_run_id: str | None = None
    turn_id: str | None = None
    session_id: str | None = None
    turn_created_ns: int | None = None
    backend: str | None = None
    ref_backend: str | None = None
    role: str | None = None
    ref_role: str | None = None
    mode: str | None = None
    status: str | None = None
    noise_floor: bool | None = None
    n: int | None = None
    flips: int | None = None
    flips_by_class: dict[str, int] | None = None
    flips_by_region_class: dict[str, dict[str, int]] | None = None
    positions_by_region: dict[str, int] | None = None
    verdict: str | None = None
    ref_tool_calls: int | None = None
    cand_tool_calls: int | None = None


def _row(d: dict[str, Any], where: str) -> ComparisonRow:
    d = dict(d)
    for k in _JSON_COLUMNS:
        v = d.get(k)
        if isinstance(v, (str, bytes)):
            try:
                d[k] = orjson.loads(v)
            except orjson.JSONDecodeError as e:
                raise TableError(f"{where}: column {k!r} is not JSON: {e}") from None
    try:
        return msgspec.convert(d, ComparisonRow, strict=False)
    except msgspec.ValidationError as e:
        raise TableError(f"{where}: {e}") from None


def row_of(c: records.Comparison, turn_id: str | None, session_id: str | None,
           turn_created_ns: int | None) -> ComparisonRow:
    """One stored comparison as its export row would read back."""
    return _row(comparison_row(c, turn_id, session_id, turn_created_ns), f"turn {turn_id}")


def from_store(store: Store) -> list[ComparisonRow]:
    """Every comparison of the store, as the export would write it (sessions in creation order)."""
    return StoreRows(store).rows()


class StoreRows:
    """:func:`from_store` for a store read again and again (the proxy's verdict every minute):
    each comparison is decoded once and kept; a later read only decodes comparisons stored since,
    found from the store's indexes (turn ids, comparison keys) without reading the records again.
    A turn moved to another session keeps its rows under its new session id; a deleted one
    (retention) is dropped. Turns without comparisons (not shadowed, or shed) hold nothing."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._created: dict[str, int] = {}  # turn id -> created_ns (a turn's time never changes)
        self._rows: dict[str, dict[tuple[str, str], ComparisonRow]] = {}  # turn id -> key -> row

    def rows(self) -> list[ComparisonRow]:
        st = self.store
        out: list[ComparisonRow] = []
        seen: set[str] = set()
        for sid, tid, keys in st.comparison_index():  # turns with comparisons, from the indexes
            seen.add(tid)
            cache = self._rows.setdefault(tid, {})
            for key in keys:
                if key not in cache:
                    if tid not in self._created:
                        self._created[tid] = st.get_turn(tid).created_ns
                    cache[key] = row_of(st.get_comparison(*key), tid, sid, self._created[tid])
            for key in set(cache) - set(keys):
                del cache[key]
            for key in keys:
                row = cache[key]
                if row.session_id != sid:  # moved by a merge or split
                    row = cache[key] = msgspec.structs.replace(row, session_id=sid)
                out.append(row)
        for tid in set(self._rows) - seen:
            self._rows.pop(tid, None)
            self._created.pop(tid, None)
        return out


def _files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = [p / f"comparisons.{ext}" for ext in ("parquet", "jsonl") if (p / f"comparisons.{ext}").is_file()]
            if not found:
                raise TableError(f"{p}: no comparisons.parquet or comparisons.jsonl in this directory "
                                 "(write one with `tensorverse export`)")
            out.append(found[0])
        elif p.is_file():
            out.append(p)
        else:
            raise TableError(f"{p}: no such file or directory")
    return out


def _check_columns(path: Path, columns: Iterable[str]) -> None:
    missing = [c for c in REQUIRED if c not in set(columns)]
    if missing:
        raise TableError(f"{path}: the comparisons table lacks column(s) {', '.join(missing)}: it was "
                         "exported by an older Tensorverse; export the store again")


def _read_jsonl(path: Path) -> Iterator[ComparisonRow]:
    with path.open("rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise TableError(f"{path}:{i}: not JSON: {e}") from None
            if not isinstance(d, dict):
                raise TableError(f"{path}:{i}: a row must be a JSON object")
            if i == 1:
                _check_columns(path, d)
            yield _row(d, f"{path}:{i}")


def _read_parquet(path: Path) -> Iterator[ComparisonRow]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TableError("reading Parquet needs pyarrow: pip install 'tensorverse[export]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise TableError(f"{path}: not a Parquet file: {e}") from None
    _check_columns(path, pf.schema_arrow.names)
    cols = [c for c in ComparisonRow.__struct_fields__ if c in pf.schema_arrow.names]
    for batch in pf.iter_batches(columns=cols, batch_size=20_000):
        for i, d in enumerate(batch.to_pylist()):
            yield _row(d, f"{path} row {i}")


def read_tables(paths: Iterable[str | os.PathLike]) -> Iterator[ComparisonRow]:
    """The rows of every ``comparisons`` table named (files or export directories), in order."""
    for path in _files(paths):
        if path.suffix == ".parquet":
            yield from _read_parquet(path)
        elif path.suffix == ".jsonl":
            yield from _read_jsonl(path)
        else:
            raise TableError(f"{path}: expected a .parquet or .jsonl comparisons table")
