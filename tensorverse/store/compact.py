"""The compact form of a logits row: what is left of a full row once it is no longer evidence.

A full Qwen3 row costs ~204 KB in the store. Once a turn's comparisons are stored (computed from
the full rows, so exact), most rows are only ever read again by the viewer's top-k panel. A
:class:`CompactRow` keeps exactly what that needs, bit for bit:

* the ``k`` highest logits with their token ids (ties broken by the lower id, as
  ``argsort(-x, kind="stable")`` orders them), as the float32 values the full row held;
* a few *extra* ids with their logits (the run's own token and the reference's token at that
  position, when they are not in the top ``k``);
* the float64 log-sum-exp of the whole row, so every kept logit is an exact log-probability
  (``logit - lse``), ranks and margins within the top ``k`` are exact, and the probability left
  outside the kept ids is known;
* the vocabulary size, the row's dtype and its codec fingerprint (``codec.row_checksum``: the
  full row's crc32, so a compact row names the row it came from).

Blob layout (version 1, little-endian)::

    offset  size   field
    0       4      magic b"TVCR"
    4       1      version (1)
    5       1      dtype code of the full row (1 float32, 2 bfloat16, 3 float16)
    6       2      k: top entries
    8       2      e: extra entries
    10      4      vocabulary size
    14      4      crc32 fingerprint of the full row
    18      8      log-sum-exp (float64)
    26      4(k+e) token ids (int32): top k in order, then the extras in id order
    ..      4(k+e) logits (float32)
    end-4   4      crc32 of every byte before it

About 180 bytes at k = 20: a thousandth of a full row.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from tensorverse.store.codec import CodecError, row_checksum

__all__ = ["check_compact", "CompactRow", "compact_row", "encode_compact", "decode_compact", "COMPACT_MAGIC", "DEFAULT_TOPK"]

COMPACT_MAGIC = b"TVCR"
_VERSION = 1
_HEAD = struct.Struct("<4sBBHHIId")
_CRC = struct.Struct("<I")
_DTYPES = {"float32": 1, "bfloat16": 2, "float16": 3}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
DEFAULT_TOPK = 20


@dataclass(frozen=True, eq=False)
class CompactRow:
    """See the module docstring. ``ids``/``logits`` hold the top ``k`` first, then the extras."""

    vocab: int
    dtype: str
    fingerprint: int
    lse: float
    k: int
    ids: np.ndarray  # int32
    logits: np.ndarray  # float32

    def logprobs(self) -> dict[int, float]:
        """Every kept id's exact log-probability (float64)."""
        return {int(t): float(v) - self.lse for t, v in zip(self.ids, self.logits)}

    def top(self, n: int) -> list[int]:
        return [int(t) for t in self.ids[: min(n, self.k)]]

    def logp(self, ids: Iterable[int]) -> list[float | None]:
        d = self.logprobs()
        return [d.get(int(t)) for t in ids]

    def rank(self, ids: Iterable[int]) -> list[int | None]:
        """Exact rank (0 = top) of a kept id whose logit is at least the k-th's; None otherwise
        (its rank is at least ``k`` but not known)."""
        top = self.logits[: self.k]
        floor = top[-1] if self.k else np.float32(np.inf)
        out: list[int | None] = []
        vals = dict(zip(map(int, self.ids), self.logits))
        for t in ids:
            v = vals.get(int(t))
            out.append(None if v is None or v < floor else int((top > v).sum()))
        return out

    @property
    def tail_mass(self) -> float:
        """The probability outside the top ``k``."""
        top = self.logits[: self.k].astype(np.float64)
        return max(0.0, 1.0 - float(np.exp(top - self.lse).sum()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompactRow) and encode_compact(self) == encode_compact(other)

    __hash__ = None  # type: ignore[assignment]


def log_sum_exp(x: np.ndarray) -> float:
    """float64 log-sum-exp of a row (NaN when it holds NaN or infinity)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    m = float(x.max()) if x.size else math.nan
    if not (math.isfinite(m) and math.isfinite(float(x.min()))):
        return math.nan
    return m + math.log(float(np.exp(x - m).sum()))


def _top_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` highest entries, by value descending then id ascending: exactly
    ``argsort(-x, kind="stable")[:k]``, without sorting the whole row."""
    if k < x.size:
        thr = x[np.argpartition(-x, k - 1)[k - 1]]
        if np.isfinite(thr):
            above = np.flatnonzero(x > thr)
            ties = np.flatnonzero(x == thr)[: k - above.size]  # the lowest ids of the tie
            part = np.concatenate([above, ties])
            return part[np.lexsort((part, -x[part]))]
    return np.argsort(-x, kind="stable")[:k]


def compact_row(x: np.ndarray, *, k: int = DEFAULT_TOPK, extra: Sequence[int] = (), dtype: str = "float32",
                fingerprint: int | None = None) -> CompactRow:
    """The compact form of the full (widened, float32) row ``x``. ``dtype`` is the stored row's
    dtype and ``fingerprint`` its codec checksum (computed from ``x`` when not given)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if not x.size:
        raise ValueError("an empty row has no compact form")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown row dtype {dtype!r}")
    if not 0 < k <= min(x.size, 0xFFFF):
        raise ValueError(f"k must be in 1..{min(x.size, 0xFFFF)}, got {k}")
    k = int(k)
    top = _top_ids(x, k)
    chosen = set(int(t) for t in top)
    ext = sorted({int(t) for t in extra if 0 <= int(t) < x.size} - chosen)
    if len(ext) > 0xFFFF:
        raise ValueError("too many extra ids")
    ids = np.concatenate([top.astype(np.int64), np.asarray(ext, dtype=np.int64)]).astype(np.int32)
    if fingerprint is None:
        fingerprint = row_checksum(x)
    return CompactRow(vocab=int(x.size), dtype=dtype, fingerprint=int(fingerprint), lse=log_sum_exp(x), k=k,
                      ids=ids, logits=x[ids].copy())


def encode_compact(c: CompactRow) -> bytes:
    n = len(c.ids)
    head = _HEAD.pack(COMPACT_MAGIC, _VERSION, _DTYPES[c.dtype], c.k, n - c.k, c.vocab, c.fingerprint & 0xFFFFFFFF,
                      float(c.lse))
    body = head + np.asarray(c.ids, dtype="<i4").tobytes() + np.asarray(c.logits, dtype="<f4").tobytes()
    return body + _CRC.pack(zlib.crc32(body))


def check_compact(blob: bytes | memoryview, *, record: str = "") -> None:
    """The checks of :func:`decode_compact` without building the row (ingest checks every
    compact frame it is sent: about a fifth of the time of a decode); a bad blob raises
    :class:`~tensorverse.store.codec.CodecError`."""
    b = bytes(blob)
    n, vocab = _checked_head(b, record)[:2]
    ids = struct.unpack_from(f"<{n}i", b, _HEAD.size)
    if n and (min(ids) < 0 or max(ids) >= vocab):
        raise CodecError(f"{_where(record)}: a token id outside the vocabulary of {vocab}", "malformed")


def _where(record: str) -> str:
    return f"compact row {record!r}" if record else "compact row"


def _checked_head(b: bytes, record: str) -> tuple[int, int, int, int, int, float]:
    """A compact blob's entries, vocabulary, dtype code, k, fingerprint and log-sum-exp, after its
    crc32, header and length checks."""
    if len(b) < _HEAD.size + _CRC.size:
        raise CodecError(f"{_where(record)}: truncated ({len(b)} bytes)", "truncated")
    if _CRC.unpack_from(b, len(b) - 4)[0] != zlib.crc32(b[:-4]):
        raise CodecError(f"{_where(record)}: checksum mismatch (corrupt or truncated)", "checksum")
    magic, version, code, k, e, vocab, fp, lse = _HEAD.unpack_from(b, 0)
    if magic != COMPACT_MAGIC:
        raise CodecError(f"{_where(record)}: not a compact row (magic {magic!r})", "magic")
    if version != _VERSION:
        raise CodecError(f"{_where(record)}: compact format {version}, this Tensorverse reads {_VERSION}", "version")
    if code not in _DTYPE_NAMES or k == 0:
        raise CodecError(f"{_where(record)}: bad header", "malformed")
    n = k + e
    if len(b) != _HEAD.size + 8 * n + _CRC.size:
        raise CodecError(f"{_where(record)}: {len(b)} bytes for {n} entries", "malformed")
    return n, vocab, code, k, fp, lse


def decode_compact(blob: bytes | memoryview, *, record: str = "") -> CompactRow:
    """Decode a compact blob, checked (the trailing crc32, the header, every id in the
    vocabulary); a bad blob raises :class:`~tensorverse.store.codec.CodecError`."""
    where = _where(record)
    b = bytes(blob)
    n, vocab, code, k, fp, lse = _checked_head(b, record)
    ids = np.frombuffer(b, dtype="<i4", count=n, offset=_HEAD.size).astype(np.int32)
    logits = np.frombuffer(b, dtype="<f4", count=n, offset=_HEAD.size + 4 * n).astype(np.float32)
    if n and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise CodecError(f"{where}: a token id outside the vocabulary of {vocab}", "malformed")
    return CompactRow(vocab=int(vocab), dtype=_DTYPE_NAMES[code], fingerprint=int(fp), lse=float(lse), k=int(k),
                      ids=ids, logits=logits)
