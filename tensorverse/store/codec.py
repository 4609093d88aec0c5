"""Lossless codec for full-vocabulary logits rows.

One blob holds one row (1-D: one position, the whole vocabulary) or a small matrix (2-D:
positions x vocabulary) of float32, bfloat16 or float16 values, bit-exact: NaN payloads,
-0.0, infinities and subnormals come back as they went in. Compare rows by bit pattern.

bfloat16
    numpy has no bfloat16, so a bfloat16 row is passed as its ``np.uint16`` bit patterns with
    ``dtype="bfloat16"``: ``encode_row(bits, dtype="bfloat16")`` (``np.int16`` bits, as from
    ``tensor.view(torch.int16).numpy()``, are accepted too). ``decode_row`` returns such a
    row as ``np.uint16`` bit patterns too (``blob_info`` says ``dtype: "bfloat16"``); widen with
    ``tensorverse.analysis.metrics.widen_bf16``. A numpy dtype named ``bfloat16`` with
    2-byte items (ml_dtypes) is accepted as well and read as its bits.

How a row is stored
    * float32 rows whose every entry is bfloat16-representable (low 16 bits zero: vLLM's rows
      usually are) keep only their high 16 bits (mode ``bf16``, 2 bytes per entry before
      compression); other float32 rows keep all 32 bits (mode ``plain``).
    * The packed bits are split into byte planes (byte-shuffle). Each plane is zstd-compressed
      (level ``level``, default 1, tuned to stay on zstd's fast Huffman path), stored raw when
      zstd would not pay (a near-random mantissa plane: a cheap sampled-entropy test decides),
      stored sparse when mostly zero (bitmap + nonzero bytes), or as nothing when all zero.
    * With ``ref=`` (a row of the same shape and dtype, typically the same position on the
      reference runtime) the planes hold the zigzag-coded integer difference of the bit patterns
      (``row_bits - ref_bits``, wrapping): runtimes that agree produce rows whose entries are
      equal or an ulp apart, so the planes are mostly zero and a bit-identical row costs a few
      dozen bytes (mode ``delta`` / ``delta_bf16``). A delta of at most one byte per 16 bits
      of the row is kept without encoding the row alone (the usual case, and the fast one);
      a larger delta is kept only when it is smaller than the row encoded alone, else the row
      is stored standalone. So a delta can be larger than the standalone blob would have been
      when both are small (a constant row against a noisy ref): a caller that must never grow
      a row compares sizes itself, as compaction does. ``blob_info`` tells which
      (``needs_ref``). Decoding a delta blob needs the same ref; a missing or different ref
      raises :class:`CodecError`.

Blob layout (version 1, little-endian)::

    offset  size  field
    0       4     magic b"TVLG"
    4       1     codec version (1)
    5       1     dtype     1 float32, 2 bfloat16, 3 float16
    6       1     mode      0 plain, 1 bf16, 2 delta, 3 delta_bf16
    7       1     ndim      (1..8)
    8       4     crc32 of the decoded row (see below)
    12      4     crc32 of the ref row (delta modes), else 0
    16      8*ndim shape (uint64 each)
    ..      1     number of planes k (2 or 4; must match dtype and mode)
    ..      5*k   per plane: method, stored length (uint32)
    ..      ...   plane payloads, in plane order (plane i = byte i of each packed entry)
    end-4   4     crc32 of every byte before it

Plane methods: 0 raw (n bytes), 1 one zstd frame, 2 all bytes zero (no payload), 3 sparse:
``<IBIB`` (nonzero count, bitmap method, bitmap length, values method), then the bitmap of
nonzero positions (``np.packbits``, raw or zstd), then the nonzero bytes (raw or zstd).

The row checksum is ``zlib.crc32`` of the row's *packed* bits as little-endian bytes: the high
16 bits of each entry for a bf16-exact float32 row (so it equals the checksum of the same row
given as bfloat16), the raw bits otherwise. It is a fingerprint of the row that ``blob_info``
exposes without decompressing (equal fingerprints: bit-identical rows, up to crc collisions),
and a delta blob's ``ref_crc32`` is the fingerprint of its ref, i.e. the ``crc32`` of the ref
row's own blob, so a store can check ref links without decoding anything.

Every blob is checked before anything is decompressed (trailing crc32 over the whole blob:
every single-byte corruption and every truncation is caught), and the decoded bits are checked
against the row checksum; any failure raises :class:`CodecError` naming the record, with its
``reason`` (`REASONS`: truncated, magic, version, checksum, malformed, reference, input).

Compressor objects are cached per thread (zstandard objects are not thread-safe); the module
functions are safe to call from several threads at once.
"""

from __future__ import annotations

import struct
import threading
import zlib

import numpy as np
import zstandard

from tensorverse.refusal import Refusal

__all__ = ["CodecError", "REASONS", "encode_row", "decode_row", "blob_info", "row_checksum",
           "CODEC_VERSION", "MAGIC"]

MAGIC = b"TVLG"
CODEC_VERSION = 1

_DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
_DTYPE_NAMES = {v: k for k, v in _DTYPE_CODES.items()}
_ITEMSIZE = {1: 4, 2: 2, 3: 2}
_MODE_PLAIN, _MODE_BF16, _MODE_DELTA, _MODE_DELTA_BF16 = 0, 1, 2, 3
_MODE_NAMES = {0: "plain", 1: "bf16", 2: "delta", 3: "delta_bf16"}
_RAW, _ZSTD, _ZERO, _SPARSE = 0, 1, 2, 3
_METHOD_NAMES = {0: "raw", 1: "zstd", 2: "zero", 3: "sparse"}

_HEAD = struct.Struct("<4sBBBBII")  # magic, version, dtype, mode, ndim, crc_row, crc_ref
_PLANE = struct.Struct("<BI")
_SPARSE_HEAD = struct.Struct("<IBIB")  # nonzero count, bitmap method, bitmap length, values method
_CRC = struct.Struct("<I")
_MAX_NDIM = 8
_MAX_ENTRIES = 1 << 40

# A plane whose sampled byte histogram has more entropy than this (bits per byte) is stored
# raw without trying zstd: zstd would save < ~2 % on it and cost as much time as the rest.
_RAW_ENTROPY_BITS = 7.6
_SAMPLE = 4096
# A plane with at most this share of nonzero bytes is stored sparse: a bitmap of the nonzero
# positions plus the nonzero bytes, each compressed on its own. Huffman coding spends at least
# one bit per byte, so a plane that is mostly zero (a delta against a near-identical ref)
# compresses much better this way (0.23 vs 0.29 bytes per entry on synthetic shadow rows).
# Below _SPARSE_MIN_DENSITY plain zstd (long zero runs) is as small and faster.
_SPARSE_MAX_DENSITY = 0.5
_SPARSE_MIN_DENSITY = 1 / 128
_SPARSE_MIN = 4096

_local = threading.local()


#: why a row or blob is refused (`CodecError.reason`): ``input`` a row or argument that cannot be
#: encoded; ``truncated`` a blob cut short; ``magic`` not a blob of this kind; ``version`` a format
#: this Tensorverse does not read; ``checksum`` corrupt (a blob's or the decoded row's checksum);
#: ``malformed`` a header, plane table or payload that contradicts itself; ``reference`` a delta
#: blob without its reference row, or with the wrong one
REASONS = ("input", "truncated", "magic", "version", "checksum", "malformed", "reference")


class CodecError(Refusal):
    """A logits blob or row that cannot be encoded or decoded; the message names the record,
    ``reason`` (one of `REASONS`) says why, for code."""

    REASONS = REASONS


def _fail(record: str, what: str, reason: str) -> CodecError:
    where = f"logits record {record!r}" if record else "logits blob"
    return CodecError(f"{where}: {what}", reason)


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        # Byte planes of logits are close to i.i.d. symbols: LZ matches rarely pay and
        # interrupt Huffman-coded literals. A long minimum match and a tiny hash table keep
        # zstd on its literal path, which is both smaller and ~3x faster here than the
        # level's defaults (level 1 on a bf16 exponent plane, measured: 0.345 vs 0.392 bytes
        # per entry, 210 vs 790 us). Long runs (masked rows, zero deltas) still match.
        params = zstandard.ZstdCompressionParameters.from_level(
            level, min_match=7, hash_log=6, write_content_size=1, write_checksum=0,
            write_dict_id=0)
        c = cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return c


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (the codec's rows, and the store's compressed turns)."""
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


# ----------------------------------------------------------------------------- packing

def _as_bits(row, dtype: str | None, what: str, record: str) -> tuple[int, np.ndarray]:
    """(dtype code, contiguous little-endian unsigned view of the row's bits)."""
    if not isinstance(row, np.ndarray):
        if hasattr(row, "__array__") or isinstance(row, (list, tuple)):
            row = np.asarray(row)
        else:
            raise _fail(record, f"{what} must be a numpy array, not {type(row).__name__}", "input")
    kind = row.dtype
    if dtype is not None and dtype not in _DTYPE_CODES:
        raise _fail(record, f"unknown dtype {dtype!r} (expected float32, bfloat16 or float16)", "input")
    order = ">" if kind.byteorder == ">" else "<"
    if kind.name == "bfloat16" and kind.itemsize == 2:  # ml_dtypes, if a caller has it
        code, bits = 2, row.view(order + "u2")
    elif kind.kind == "f" and kind.itemsize == 4:
        code, bits = 1, row.view(order + "u4")
    elif kind.kind == "f" and kind.itemsize == 2:
        code, bits = 3, row.view(order + "u2")
    elif kind.kind in "ui" and kind.itemsize == 2 and dtype == "bfloat16":
        code, bits = 2, row.view(order + "u2")  # int16 too: torch's .view(torch.int16)
    else:
        hint = (" (pass bfloat16 bit patterns as np.uint16 with dtype='bfloat16')"
                if kind.kind in "ui" and kind.itemsize == 2 else "")
        raise _fail(record, f"{what} has dtype {kind}, expected float32, float16 or "
                            f"bfloat16 bits{hint}", "input")
    if dtype is not None and _DTYPE_CODES[dtype] != code:
        raise _fail(record, f"{what} has dtype {kind}, which does not match dtype={dtype!r}", "input")
    if bits.ndim < 1 or bits.ndim > _MAX_NDIM:
        raise _fail(record, f"{what} must have 1 to {_MAX_NDIM} dimensions, got {bits.ndim}", "input")
    if bits.dtype.byteorder == ">":
        bits = bits.astype(bits.dtype.newbyteorder("<"))
    return code, np.ascontiguousarray(bits)


def _packed(code: int, bits: np.ndarray) -> tuple[bool, np.ndarray]:
    """(bf16-packed?, packed bits: flat contiguous uint16, or uint32 for full float32)."""
    flat = bits.reshape(bits.size)
    if code != 1:
        return False, flat
    # bf16-exact <=> every low half is zero. ufuncs (SIMD) beat strided copies here.
    if flat.size and flat.astype(np.uint16).any():
        return False, flat
    return True, (flat >> 16).astype(np.uint16)


def _split(pk: np.ndarray) -> list[np.ndarray]:
    """Byte planes of packed bits (plane i = byte i of each entry), each contiguous uint8."""
    return [pk.astype(np.uint8) if i == 0 else (pk >> (8 * i)).astype(np.uint8)
            for i in range(pk.dtype.itemsize)]


def _join(planes: list, n: int, width: int) -> np.ndarray:
    """Inverse of _split; a plane of None is all zero."""
    kind = np.uint16 if width == 2 else np.uint32
    out = None
    for i in range(width - 1, -1, -1):
        p = planes[i]
        if p is None:
            continue
        if out is None:
            out = np.left_shift(p, 8 * i, dtype=kind) if i else p.astype(kind)
        elif i:
            np.bitwise_or(out, np.left_shift(p, 8 * i, dtype=kind), out=out)
        else:
            np.bitwise_or(out, p, out=out)
    return np.zeros(n, kind) if out is None else out


def row_checksum(row, *, dtype: str | None = None) -> int:
    """The crc32 a blob of ``row`` records (``blob_info(blob)["crc32"]``): a bit fingerprint."""
    code, bits = _as_bits(row, dtype, "row", "")
    return zlib.crc32(_packed(code, bits)[1].data)


# ----------------------------------------------------------------------------- planes

def _entropy_bits(plane: np.ndarray) -> float:
    n = plane.size
    sample = plane[:: max(1, n // _SAMPLE)] if n > _SAMPLE else plane
    counts = np.bincount(sample, minlength=256)
    p = counts[counts > 0] / sample.size
    return float(-(p * np.log2(p)).sum())


def _nbytes(part) -> int:
    return len(part) if isinstance(part, bytes) else part.nbytes


def _encode_dense(p: np.ndarray, comp) -> tuple[int, list]:
    n = p.size
    if n >= 1024 and _entropy_bits(p) > _RAW_ENTROPY_BITS:
        return _RAW, [p]
    z = comp.compress(p)
    if len(z) < n:
        return _ZSTD, [z]
    return _RAW, [p]


def _encode_plane(p: np.ndarray, comp) -> tuple[int, list]:
    """(method, payload parts) of one byte plane."""
    n = p.size
    nz = int(np.count_nonzero(p))
    if nz == 0:
        return _ZERO, []
    if n >= _SPARSE_MIN and n * _SPARSE_MIN_DENSITY <= nz <= n * _SPARSE_MAX_DENSITY:
        mask = p != 0
        bm_method, bm_parts = _encode_dense(np.packbits(mask), comp)
        # np.compress, not p[mask]: boolean indexing is ~5x slower on a random mask
        v_method, v_parts = _encode_dense(np.compress(mask, p), comp)
        head = _SPARSE_HEAD.pack(nz, bm_method, sum(map(_nbytes, bm_parts)), v_method)
        return _SPARSE, [head, *bm_parts, *v_parts]
    return _encode_dense(p, comp)


def _encode_planes(planes: list, level: int) -> tuple[list[bytes], list, int]:
    """(plane table entries, payload parts, payload size) for byte planes."""
    table, payloads, total = [], [], 0
    comp = _compressor(level)
    for p in planes:
        method, parts = _encode_plane(p, comp)
        size = sum(map(_nbytes, parts))
        table.append(_PLANE.pack(method, size))
        payloads += parts
        total += size
    return table, payloads, total


def _zigzag_delta(row: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """zigzag(row - ref) in wrapping unsigned arithmetic (same width as the inputs)."""
    d = np.subtract(row, ref)
    bits = d.dtype.itemsize * 8
    sign = (d >> (bits - 1)).astype(d.dtype, copy=False)
    np.negative(sign, out=sign)  # 0 or all ones
    np.left_shift(d, 1, out=d)
    np.bitwise_xor(d, sign, out=d)
    return d


def _unzigzag(z: np.ndarray) -> np.ndarray:
    s = z & 1
    np.negative(s, out=s)
    np.right_shift(z, 1, out=z)
    np.bitwise_xor(z, s, out=z)
    return z


# ----------------------------------------------------------------------------- encode

def encode_row(row: np.ndarray, *, ref: np.ndarray | None = None, level: int = 1,
               dtype: str | None = None, record: str = "") -> bytes:
    """Encode one logits row (or a positions x vocabulary matrix) losslessly.

    ``row``: float32, float16, or bfloat16 bit patterns as ``np.uint16`` with
    ``dtype="bfloat16"``. ``ref``: optional row of the same shape and dtype to delta against.
    ``level``: zstd level (1 is fast and about as small as higher levels on this data).
    ``record`` names the record in error messages.
    """
    if not isinstance(level, int) or isinstance(level, bool) or not -7 <= level <= 22:
        raise _fail(record, f"zstd level must be an int in -7..22, got {level!r}", "input")
    code, bits = _as_bits(row, dtype, "row", record)
    if bits.size > _MAX_ENTRIES:
        raise _fail(record, f"row too large ({bits.size} entries)", "input")
    shape = bits.shape
    n = bits.size
    bf16, pk = _packed(code, bits)
    crc_row = zlib.crc32(pk.data)

    mode = _MODE_BF16 if bf16 else _MODE_PLAIN
    crc_ref = 0
    planes: tuple[list[bytes], list] | None = None  # (plane table, payloads) once a ref chose them
    if ref is not None:
        rcode, rbits = _as_bits(ref, _DTYPE_NAMES[code], "ref", record)
        if rbits.shape != shape:
            raise _fail(record, f"ref has shape {rbits.shape}, row has shape {shape}", "reference")
        ref_bf16, rpk = _packed(rcode, rbits)
        crc_ref = zlib.crc32(rpk.data)
        both16 = bf16 and ref_bf16
        if code == 1 and not both16:  # 32-bit delta
            z = _zigzag_delta(bits.reshape(n), rbits.reshape(n))
        else:
            z = _zigzag_delta(pk, rpk)
        dtable, dpayloads, dsize = _encode_planes(_split(z), level)
        delta_mode = _MODE_DELTA_BF16 if both16 else _MODE_DELTA
        if dsize <= n * max(1, pk.dtype.itemsize // 2):  # clearly cheaper than standalone
            mode, planes = delta_mode, (dtable, dpayloads)
        else:  # a ref that does not help (another model, another prompt): keep the smaller
            stable, spayloads, ssize = _encode_planes(_split(pk), level)
            if dsize < ssize:
                mode, planes = delta_mode, (dtable, dpayloads)
            else:
                planes = stable, spayloads
        if mode != delta_mode:
            crc_ref = 0
    if planes is None:
        planes = _encode_planes(_split(pk), level)[:2]
    table, payloads = planes

    head = _HEAD.pack(MAGIC, CODEC_VERSION, code, mode, len(shape), crc_row, crc_ref)
    parts = [head, struct.pack("<%dQ" % len(shape), *shape), bytes((len(table),)), *table,
             *payloads]
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


# ----------------------------------------------------------------------------- decode

def _parse(blob, record: str):
    """Validate framing + blob crc; return header fields and plane (method, memoryview) list."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise _fail(record, f"blob must be bytes, not {type(blob).__name__}", "input")
    mv = memoryview(blob)
    if mv.ndim != 1 or mv.itemsize != 1:
        try:
            mv = mv.cast("B")
        except TypeError as e:
            raise _fail(record, f"blob buffer is not contiguous bytes: {e}", "input") from None
    size = mv.nbytes
    minimum = _HEAD.size + 8 + 1 + _CRC.size
    if size < minimum:
        raise _fail(record, f"blob truncated ({size} bytes, a blob has at least {minimum})", "truncated")
    if mv[:4] != MAGIC:
        raise _fail(record, "not a logits blob (bad magic)", "magic")
    (stored_crc,) = _CRC.unpack_from(mv, size - 4)
    if zlib.crc32(mv[: size - 4]) != stored_crc:
        raise _fail(record, "blob checksum mismatch (corrupt or truncated)", "checksum")
    _, version, code, mode, ndim, crc_row, crc_ref = _HEAD.unpack_from(mv, 0)
    if version != CODEC_VERSION:
        raise _fail(record, f"unsupported codec version {version} (this is {CODEC_VERSION})", "version")
    if code not in _DTYPE_NAMES:
        raise _fail(record, f"unknown dtype code {code}", "malformed")
    if mode not in _MODE_NAMES:
        raise _fail(record, f"unknown mode code {mode}", "malformed")
    if not 1 <= ndim <= _MAX_NDIM:
        raise _fail(record, f"bad ndim {ndim}", "malformed")
    off = _HEAD.size
    if size < off + 8 * ndim + 1 + _CRC.size:
        raise _fail(record, "blob truncated in the shape", "truncated")
    shape = struct.unpack_from("<%dQ" % ndim, mv, off)
    off += 8 * ndim
    n = 1
    for s in shape:
        n *= s
    if n > _MAX_ENTRIES:
        raise _fail(record, f"implausible shape {shape}", "malformed")
    k = mv[off]
    off += 1
    if mode in (_MODE_BF16, _MODE_DELTA_BF16) and code != 1:
        raise _fail(record, f"mode {_MODE_NAMES[mode]} with dtype {_DTYPE_NAMES[code]}", "malformed")
    want = 2 if mode in (_MODE_BF16, _MODE_DELTA_BF16) else _ITEMSIZE[code]
    if k != want:
        raise _fail(record, f"{k} byte planes for dtype {_DTYPE_NAMES[code]}, "
                            f"mode {_MODE_NAMES[mode]} (expected {want})", "malformed")
    if size < off + _PLANE.size * k + _CRC.size:
        raise _fail(record, "blob truncated in the plane table", "truncated")
    planes = []
    pos = off + _PLANE.size * k
    for i in range(k):
        method, length = _PLANE.unpack_from(mv, off + _PLANE.size * i)
        if method not in _METHOD_NAMES:
            raise _fail(record, f"plane {i}: unknown method {method}", "malformed")
        if method == _ZERO and length != 0:
            raise _fail(record, f"plane {i}: zero plane with {length} bytes", "malformed")
        planes.append((method, mv[pos: pos + length]))
        pos += length
    if pos != size - _CRC.size:
        raise _fail(record, f"plane lengths add up to {pos - off} bytes, blob body has "
                            f"{size - _CRC.size - off}", "malformed")
    return code, mode, shape, n, crc_row, crc_ref, planes


def _dense_bytes(method: int, data: memoryview, n: int, what: str, record: str):
    if method == _RAW:
        if data.nbytes != n:
            raise _fail(record, f"{what}: raw data of {data.nbytes} bytes, expected {n}", "malformed")
        return np.frombuffer(data, np.uint8, n)
    if method != _ZSTD:
        raise _fail(record, f"{what}: bad method {method}", "malformed")
    try:
        out = decompressor().decompress(data, max_output_size=n)
    except zstandard.ZstdError as e:
        raise _fail(record, f"{what}: zstd error: {e}", "malformed") from None
    if len(out) != n:
        raise _fail(record, f"{what}: decompressed to {len(out)} bytes, expected {n}", "malformed")
    return np.frombuffer(out, np.uint8)


def _plane_bytes(method: int, data: memoryview, n: int, i: int, record: str):
    """One decoded byte plane (n uint8, read-only), or None for an all-zero plane."""
    if method == _ZERO:
        return None
    if method != _SPARSE:
        return _dense_bytes(method, data, n, f"plane {i}", record)
    if data.nbytes < _SPARSE_HEAD.size:
        raise _fail(record, f"plane {i}: sparse header truncated", "truncated")
    nz, bm_method, bm_len, v_method = _SPARSE_HEAD.unpack_from(data, 0)
    start = _SPARSE_HEAD.size
    if not 0 < nz <= n or start + bm_len > data.nbytes:
        raise _fail(record, f"plane {i}: bad sparse header", "malformed")
    bm = _dense_bytes(bm_method, data[start: start + bm_len], (n + 7) // 8,
                      f"plane {i} bitmap", record)
    vals = _dense_bytes(v_method, data[start + bm_len:], nz, f"plane {i} values", record)
    idx = np.flatnonzero(np.unpackbits(bm, count=n).view(bool))  # faster than bool scatter
    if idx.size != nz:
        raise _fail(record, f"plane {i}: sparse bitmap has {idx.size} entries, header "
                            f"says {nz}", "malformed")
    out = np.zeros(n, np.uint8)
    out[idx] = vals
    return out


def decode_row(blob: bytes | memoryview, *, ref: np.ndarray | None = None,
               record: str = "") -> np.ndarray:
    """Decode a blob from :func:`encode_row`, bit-exact.

    Returns float32 / float16 arrays, or ``np.uint16`` bit patterns for bfloat16. ``ref`` must
    be the row the blob was delta-encoded against (ignored for standalone blobs). ``record``
    names the record in error messages.
    """
    code, mode, shape, n, crc_row, crc_ref, planes = _parse(blob, record)
    raw = [_plane_bytes(m, data, n, i, record) for i, (m, data) in enumerate(planes)]
    width = len(planes)
    if mode in (_MODE_PLAIN, _MODE_BF16):
        pk = _join(raw, n, width)
        if zlib.crc32(pk.data) != crc_row:
            raise _fail(record, "decoded row checksum mismatch", "checksum")
        if mode == _MODE_BF16:
            return np.left_shift(pk, 16, dtype=np.uint32).view(np.float32).reshape(shape)
        return _finish(pk, code, shape)
    # delta modes
    if ref is None:
        raise _fail(record, "blob is delta-encoded against a reference row; pass ref=", "reference")
    rcode, rbits = _as_bits(ref, _DTYPE_NAMES[code], "ref", record)
    if rbits.shape != tuple(shape):
        raise _fail(record, f"ref has shape {rbits.shape}, blob has shape {tuple(shape)}", "reference")
    ref_bf16, rpk = _packed(rcode, rbits)
    if zlib.crc32(rpk.data) != crc_ref:
        raise _fail(record, "ref does not match the row this blob was encoded against "
                            "(ref checksum mismatch)", "reference")
    if mode == _MODE_DELTA_BF16:
        if not ref_bf16:
            raise _fail(record, "ref is not bf16-exact but the blob is a bf16 delta", "reference")
        base = rpk
    else:
        base = rbits.reshape(n) if code == 1 else rpk
    bits = np.add(base, _unzigzag(_join(raw, n, width)))
    if mode == _MODE_DELTA_BF16:
        if zlib.crc32(bits) != crc_row:
            raise _fail(record, "decoded row checksum mismatch", "checksum")
        return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32).reshape(shape)
    # the checksum is over the row's own packing (a bf16-exact row delta-coded in 32 bits
    # against a full float32 ref is checksummed as bf16)
    if zlib.crc32(_packed(code, bits)[1].data) != crc_row:
        raise _fail(record, "decoded row checksum mismatch", "checksum")
    return _finish(bits, code, shape)


def _finish(bits: np.ndarray, code: int, shape) -> np.ndarray:
    if code == 1:
        return bits.view(np.float32).reshape(shape)
    if code == 3:
        return bits.view(np.float16).reshape(shape)
    return bits.reshape(shape)  # bfloat16 bit patterns


def blob_info(blob: bytes | memoryview, *, record: str = "") -> dict:
    """Header facts of a blob without decompressing it (the blob crc is still verified).

    Keys: version, dtype ("float32"/"bfloat16"/"float16"), shape (tuple), mode
    ("plain"/"bf16"/"delta"/"delta_bf16"), needs_ref (bool), nbytes (blob size), entries,
    raw_nbytes (size of the decoded array), bytes_per_entry, crc32 (row checksum),
    ref_crc32 (delta modes, else None), planes (list of method names).
    """
    code, mode, shape, n, crc_row, crc_ref, planes = _parse(blob, record)
    nbytes = memoryview(blob).nbytes
    delta = mode in (_MODE_DELTA, _MODE_DELTA_BF16)
    return {
        "version": CODEC_VERSION,
        "dtype": _DTYPE_NAMES[code],
        "shape": tuple(shape),
        "mode": _MODE_NAMES[mode],
        "needs_ref": delta,
        "nbytes": nbytes,
        "entries": n,
        "raw_nbytes": n * _ITEMSIZE[code],
        "bytes_per_entry": nbytes / n if n else float(nbytes),
        "crc32": crc_row,
        "ref_crc32": crc_ref if delta else None,
        "planes": [_METHOD_NAMES[m] for m, _ in planes],
    }
