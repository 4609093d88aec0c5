"""Writing and reading results bundles (:mod:`tensorverse.bundle.format`).

The writer is deterministic: members in a fixed order, tar headers with mtime 0, owner 0, mode
0644; canonical JSON (sorted keys); Parquet tables sorted by (setting order, case, turn,
position), zstd-compressed. The same rows give the same bytes; only the manifest's ``created``
differs between two runs.

The reader treats a bundle as hostile: it looks at the tar headers first and refuses links,
directories, paths, unknown or duplicate members and anything over :class:`~tensorverse.bundle.format.Limits`
before it reads a member; a Parquet table's row count and decompressed size are read from its
footer and checked before a page is decompressed; its columns must be the format's, exactly.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from tensorverse.bundle.format import (DEFAULT_LIMITS, FREE, FREE_COLUMNS, MANIFEST, MEMBERS,
                                       POSITION_COLUMNS, POSITIONS, PROVENANCE, SUMMARIES, BundleRefused,
                                       Limits, free_schema, positions_schema)
from tensorverse.bundle.manifest import validate_manifest

__all__ = ["write_bundle", "open_bundle", "Bundle", "canonical_json", "sha256"]


def canonical_json(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _sorted_rows(rows: Sequence[Mapping[str, Any]], order: Mapping[str, int], cols: Sequence[str]) -> list:
    key = [c for c in ("case", "turn", "position") if c in cols]
    return sorted(rows, key=lambda r: (order.get(r["setting"], len(order)), r["setting"], *(r[k] for k in key)))


def _table_bytes(rows: Sequence[Mapping[str, Any]], columns, schema) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.table({n: [r.get(n) for r in rows] for n, _ in columns}, schema=schema)
    buf = io.BytesIO()
    pq.write_table(t, buf, compression="zstd", row_group_size=1 << 20)
    return buf.getvalue()


def write_bundle(path: str | os.PathLike, manifest: Mapping[str, Any], positions: Sequence[Mapping[str, Any]],
                 free: Sequence[Mapping[str, Any]], summaries: Mapping[str, Any],
                 provenance: Mapping[str, Any]) -> Path:
    """Write the bundle to ``path`` (through a temporary file: a reader never sees half of
    one). ``manifest`` is everything but ``members``, which is filled in here."""
    order = {s["name"]: i for i, s in enumerate(manifest["settings"])}
    data = {
        POSITIONS: _table_bytes(_sorted_rows(positions, order, [c for c, _ in POSITION_COLUMNS]),
                                POSITION_COLUMNS, positions_schema()),
        FREE: _table_bytes(_sorted_rows(free, order, [c for c, _ in FREE_COLUMNS]), FREE_COLUMNS, free_schema()),
        SUMMARIES: canonical_json(summaries),
        PROVENANCE: canonical_json(provenance),
    }
    m = dict(manifest, members={k: {"sha256": sha256(v), "bytes": len(v)} for k, v in data.items()})
    validate_manifest(m)
    data = {MANIFEST: canonical_json(m), **data}
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        for name in MEMBERS:
            b = data[name]
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(b), 0, 0o644, 0, 0, "", ""
            tf.addfile(ti, io.BytesIO(b))
    os.replace(tmp, p)
    return p


@dataclass
class Bundle:
    """A bundle read into memory (within the limits): its members' bytes and the manifest."""

    path: Path
    members: dict[str, bytes]
    limits: Limits = DEFAULT_LIMITS
    _manifest: dict[str, Any] | None = field(default=None, repr=False)

    def json(self, name: str) -> Any:
        b = self.members[name]
        if len(b) > self.limits.json_bytes:
            raise BundleRefused("too_large", f"{name} is {len(b)} bytes (limit {self.limits.json_bytes})")
        try:
            return json.loads(b.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError) as e:
            raise BundleRefused("schema", f"{name} is not JSON: {e}") from None
        except RecursionError:  # nested deeper than the parser's stack ("[" * 100000)
            raise BundleRefused("schema", f"{name} is nested too deep to read") from None

    @property
    def manifest(self) -> dict[str, Any]:
        if self._manifest is None:
            self._manifest = self.json(MANIFEST)
        return self._manifest

    def rows(self, name: str) -> list[dict[str, Any]]:
        """The rows of a table, after its footer passed the limits and its columns the format."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        want = positions_schema() if name == POSITIONS else free_schema()
        try:
            f = pq.ParquetFile(pa.BufferReader(self.members[name]))
            md = f.metadata
        except Exception as e:  # noqa: BLE001 - anything pyarrow says of a bad footer
            raise BundleRefused("schema", f"{name} is not a Parquet file: {e}") from None
        if md.num_rows > self.limits.table_rows:
            raise BundleRefused("too_large", f"{name} has {md.num_rows} rows (limit {self.limits.table_rows})")
        raw = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
        if raw > self.limits.table_uncompressed_bytes or raw < 0:
            raise BundleRefused("too_large", f"{name} decompresses to {raw} bytes "
                                             f"(limit {self.limits.table_uncompressed_bytes})")
        if not f.schema_arrow.equals(want):
            raise BundleRefused("schema", f"{name}'s columns are {f.schema_arrow.names} "
                                          f"({', '.join(str(t) for t in f.schema_arrow.types)}), not format 1's")
        try:
            return f.read().to_pylist()
        except Exception as e:  # noqa: BLE001
            raise BundleRefused("schema", f"{name} cannot be read: {e}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def open_bundle(path: str | os.PathLike, limits: Limits = DEFAULT_LIMITS) -> Bundle:
    """Read the bundle's members into memory, refusing an unsafe or oversized one first."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as e:
        raise BundleRefused("unreadable", f"{p}: {e.strerror}") from None
    if not p.is_file():
        raise BundleRefused("unreadable", f"{p} is not a file")
    if size > limits.bundle_bytes:
        raise BundleRefused("too_large", f"{p.name} is {size} bytes (limit {limits.bundle_bytes})")
    try:
        tf = tarfile.open(p, "r:")  # uncompressed only: no decompression bomb at this level
    except (tarfile.TarError, OSError) as e:
        raise BundleRefused("unreadable", f"{p.name} is not an uncompressed tar file: {e}") from None
    members: dict[str, bytes] = {}
    with tf:
        infos = []
        try:
            for ti in tf:  # headers only
                infos.append(ti)
                if len(infos) > len(MEMBERS):
                    raise BundleRefused("unsafe_member", f"more than {len(MEMBERS)} members")
        except BundleRefused:
            raise
        except (tarfile.TarError, OSError, ValueError, EOFError) as e:  # a header whose size seeks nowhere
            raise BundleRefused("unreadable", f"{p.name}: {e}") from None
        for ti in infos:
            if ti.name not in MEMBERS:
                raise BundleRefused("unsafe_member", f"member {ti.name!r} is not one of {', '.join(MEMBERS)}")
            if ti.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):  # not isreg(): no sparse or contiguous files
                raise BundleRefused("unsafe_member", f"member {ti.name!r} is not a regular file "
                                                     f"(links and directories are refused)")
            if ti.name in members:
                raise BundleRefused("unsafe_member", f"member {ti.name!r} appears twice")
            if ti.size < 0:
                raise BundleRefused("unreadable", f"member {ti.name} has a negative size ({ti.size})")
            if ti.size > limits.member_bytes:
                raise BundleRefused("too_large", f"member {ti.name} is {ti.size} bytes (limit {limits.member_bytes})")
            members[ti.name] = b""
        for name in MEMBERS:
            if name not in members:
                raise BundleRefused("missing_member", f"{p.name} has no {name}")
        for ti in infos:
            try:
                fh = tf.extractfile(ti)
                members[ti.name] = fh.read(ti.size + 1) if fh is not None else b""
            except (tarfile.TarError, OSError, ValueError, EOFError) as e:
                raise BundleRefused("unreadable", f"member {ti.name} cannot be read: {e}") from None
            if len(members[ti.name]) != ti.size:
                raise BundleRefused("unreadable", f"member {ti.name} is truncated")
    return Bundle(p, members, limits)
