"""The logits codec's encoder: its input checks, its plane-method choices and the compressor cache.

Checked value by value on the encode side of ``tensorverse/store/codec.py``: every refused
input with its exact message (and the record it names), the boundaries of the zstd level and of
the dimension count, the inputs it accepts (lists, objects with ``__array__``, a numpy dtype named
``bfloat16``), how each byte plane is stored (raw, zstd, zero, sparse) at the edges of each rule,
when a delta is kept, the header's ref checksum, the zstd frames themselves, and the per-thread
compressor and decompressor caches.

Expected values come from the documented blob layout (read with ``struct``), from
``blob_info(blob)["planes"]``, and from zstandard itself, never from the codec's own helpers.
"""

from __future__ import annotations

import struct
import threading
import zlib

import numpy as np
import pytest
import zstandard

from tensorverse.store import codec
from tensorverse.store.codec import CodecError, blob_info, decode_row, encode_row, row_checksum

REC = "rec-7"
AT = f"logits record {REC!r}: "


def refused(call, *args, **kw) -> str:
    with pytest.raises(CodecError) as e:
        call(*args, **kw)
    return str(e.value)


def planes_of(blob: bytes) -> list[tuple[int, bytes]]:
    """(method, payload) of each plane, read by the documented layout (version 1)."""
    ndim = blob[7]
    off = 16 + 8 * ndim
    k = blob[off]
    off += 1
    table = [struct.unpack_from("<BI", blob, off + 5 * i) for i in range(k)]
    pos = off + 5 * k
    out = []
    for method, length in table:
        out.append((method, blob[pos: pos + length]))
        pos += length
    assert pos == len(blob) - 4
    return out


def ref_crc_field(blob: bytes) -> int:
    """The header's crc32 of the ref row (offset 12): 0 unless the blob is a delta."""
    return struct.unpack_from("<I", blob, 12)[0]


def bf16_bits(lo: np.ndarray, hi: np.ndarray | int = 0) -> np.ndarray:
    """bfloat16 bit patterns whose byte planes are ``lo`` (byte 0) and ``hi`` (byte 1)."""
    return (np.asarray(hi, np.uint16) << 8) | lo.astype(np.uint16)


def round_trips(row, **kw) -> bytes:
    blob = encode_row(row, **kw)
    back = decode_row(blob, ref=kw.get("ref"))
    assert back.tobytes() == np.ascontiguousarray(row).tobytes()
    return blob


def exponent_heavy_row(n: int, seed: int = 0) -> np.ndarray:
    """bf16-exact float32 Gaussian logits: a compressible exponent plane, a noisy mantissa."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 2.0).astype(np.float32)
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


# ------------------------------------------------------------------ compressor cache

def test_compressors_and_the_decompressor_are_cached_per_thread():
    c1, c3 = codec._compressor(1), codec._compressor(3)
    assert codec._compressor(1) is c1 and codec._compressor(3) is c3 and c1 is not c3
    d = codec.decompressor()
    assert isinstance(d, zstandard.ZstdDecompressor) and codec.decompressor() is d
    seen = {}

    def other():
        seen["c"], seen["c again"] = codec._compressor(1), codec._compressor(1)
        seen["d"], seen["d again"] = codec.decompressor(), codec.decompressor()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["c"] is seen["c again"] and seen["c"] is not c1
    assert seen["d"] is seen["d again"] and seen["d"] is not d


# ------------------------------------------------------------------ zstd frames

def encoded_in_a_new_thread(row, **kw) -> bytes:
    """encode_row in a fresh thread: its compressor cache is empty, so the compressor for the
    level is built for this call (in a thread that already encoded, a cached one is reused and
    how it was built is never looked at again)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("blob", encode_row(row, **kw)))
    t.start()
    t.join()
    return out["blob"]


def test_zstd_frames_record_their_size_and_carry_no_checksum_or_dictionary():
    """The blob's trailing crc32 covers every frame, so frames carry no checksum of their own."""
    row = exponent_heavy_row(4096)
    blob = encoded_in_a_new_thread(row)
    assert blob_info(blob)["planes"] == ["raw", "zstd"]  # mantissa raw, exponent zstd
    method, frame = planes_of(blob)[1]
    assert method == 1
    fp = zstandard.get_frame_parameters(frame)
    assert fp.content_size == 4096 and not fp.has_checksum and fp.dict_id == 0


def test_zstd_frames_are_the_tuned_ones_at_the_requested_level():
    """Each frame is zstd's at ``level`` with the codec's tuning (min_match 7, hash_log 6: stay on
    the literal path), which at level 1 beats zstd's own level-1 parameters on an exponent plane."""
    row = exponent_heavy_row(16384, seed=5)
    exponent = ((row.view(np.uint32) >> 24).astype(np.uint8)).tobytes()
    for level in (1, 3, 9):
        blob = encoded_in_a_new_thread(row, level=level)
        method, frame = planes_of(blob)[1]
        assert method == 1
        params = zstandard.ZstdCompressionParameters.from_level(
            level, min_match=7, hash_log=6, write_content_size=1, write_checksum=0,
            write_dict_id=0)
        assert frame == zstandard.ZstdCompressor(compression_params=params).compress(exponent)
        assert zstandard.ZstdDecompressor().decompress(frame) == exponent
    _, tuned = planes_of(encoded_in_a_new_thread(row, level=1))[1]
    assert len(tuned) < len(zstandard.ZstdCompressor(level=1).compress(exponent))


def test_the_level_reaches_zstd():
    """Negative levels skip entropy coding: the exponent plane no longer pays and is stored raw."""
    row = exponent_heavy_row(4096)
    assert blob_info(round_trips(row, level=-7))["planes"] == ["raw", "raw"]
    assert blob_info(round_trips(row, level=1))["planes"] == ["raw", "zstd"]


def test_the_default_level_is_1():
    """A 4 x 151936 bfloat16 matrix: planes of 600K bytes, where level 2's larger window shows."""
    rng = np.random.default_rng(0)
    n = 4 * 151936
    m = bf16_bits(rng.integers(1, 64, n), rng.integers(1, 64, n)).reshape(4, 151936)
    default = encode_row(m, dtype="bfloat16")
    assert default == encode_row(m, dtype="bfloat16", level=1)
    assert default != encode_row(m, dtype="bfloat16", level=2)
    assert decode_row(default).tobytes() == m.tobytes()


# ------------------------------------------------------------------ the level

def test_level_bounds_are_inclusive():
    row = exponent_heavy_row(2000)
    for level in (-7, 22):
        round_trips(row, level=level)
    for bad in (-8, 23, True, 1.5, "1", None):
        assert refused(encode_row, row, level=bad, record=REC) == (
            AT + f"zstd level must be an int in -7..22, got {bad!r}")


# ------------------------------------------------------------------ the row

def test_refused_rows_with_their_exact_messages():
    msg = ", expected float32, float16 or bfloat16 bits"
    hint = " (pass bfloat16 bit patterns as np.uint16 with dtype='bfloat16')"
    cases = [
        ("not an array", {}, "row must be a numpy array, not str"),
        (7, {}, "row must be a numpy array, not int"),
        (np.zeros(4, np.float32), {"dtype": "float64"},
         "unknown dtype 'float64' (expected float32, bfloat16 or float16)"),
        (np.zeros(4, np.int32), {}, "row has dtype int32" + msg),
        (np.zeros(4, np.float64), {}, "row has dtype float64" + msg),
        (np.zeros(4, np.uint8), {}, "row has dtype uint8" + msg),
        (np.zeros(4, "S2"), {}, "row has dtype |S2" + msg),
        (np.zeros(4, np.uint16), {}, "row has dtype uint16" + msg + hint),
        (np.zeros(4, np.int16), {}, "row has dtype int16" + msg + hint),
        (np.zeros(4, np.uint16), {"dtype": "float16"}, "row has dtype uint16" + msg + hint),
        (np.zeros(4, np.float32), {"dtype": "bfloat16"},
         "row has dtype float32, which does not match dtype='bfloat16'"),
        (np.zeros(4, np.float16), {"dtype": "float32"},
         "row has dtype float16, which does not match dtype='float32'"),
        (np.float32(1.0), {}, "row must have 1 to 8 dimensions, got 0"),
        (np.zeros((1,) * 9, np.float32), {}, "row must have 1 to 8 dimensions, got 9"),
    ]
    for row, kw, what in cases:
        assert refused(encode_row, row, record=REC, **kw) == AT + what
        assert refused(encode_row, row, **kw) == "logits blob: " + what


def test_eight_dimensions_are_accepted():
    row = np.arange(6, dtype=np.float32).reshape((1,) * 7 + (6,))
    blob = round_trips(row)
    assert blob_info(blob)["shape"] == (1,) * 7 + (6,) and blob[7] == 8


def test_row_checksum_checks_its_row_the_same_way_and_names_no_record():
    msg = ", expected float32, float16 or bfloat16 bits"
    assert refused(row_checksum, np.zeros(3, np.int32)) == "logits blob: row has dtype int32" + msg
    assert refused(row_checksum, np.zeros(3, np.float32), dtype="float16") == (
        "logits blob: row has dtype float32, which does not match dtype='float16'")
    assert refused(row_checksum, [1, 2]) == "logits blob: row has dtype int64" + msg


def test_lists_tuples_and_array_likes_are_read_as_arrays():
    vals = [np.float32(1.5), np.float32(-2.0), np.float32(0.1)]
    want = np.array(vals, np.float32)

    class ArrayLike:
        def __array__(self, dtype=None, copy=None):
            return want.copy()

    for row in (vals, tuple(vals), ArrayLike()):
        blob = encode_row(row)
        assert decode_row(blob).tobytes() == want.tobytes()
        assert blob_info(blob)["crc32"] == zlib.crc32(want.tobytes())
        assert row_checksum(row) == zlib.crc32(want.tobytes())


def test_a_numpy_dtype_named_bfloat16_is_read_as_its_bits():
    """As ml_dtypes' bfloat16 would be: any numpy dtype named "bfloat16" with 2-byte items (here a
    void subclass, so the test needs no ml_dtypes)."""

    class bfloat(np.void):  # numpy names it "bfloat" + bits: "bfloat16"
        pass

    bits = np.array([0x3F80, 0xBFC0, 0x7FC1, 0x0001, 0x8000, 0xFF80], np.uint16)
    row = bits.view(np.dtype((bfloat, 2)))
    assert row.dtype.name == "bfloat16" and row.dtype.kind == "V"
    blob = encode_row(row, record=REC)
    info = blob_info(blob)
    assert info["dtype"] == "bfloat16" and info["mode"] == "plain"
    assert info["crc32"] == zlib.crc32(bits.tobytes()) == row_checksum(row)
    back = decode_row(blob)
    assert back.dtype == np.uint16 and back.tobytes() == bits.tobytes()
    assert encode_row(row, dtype="bfloat16") == blob == encode_row(bits, dtype="bfloat16")


def test_matrices_with_long_planes_round_trip():
    """A 4 x 1024 matrix: each plane is long enough for the entropy test."""
    full = np.random.default_rng(2).standard_normal((4, 1024)).astype(np.float32)
    round_trips(full)
    round_trips(full, ref=full)
    b16 = exponent_heavy_row(4096).reshape(4, 1024)
    assert blob_info(round_trips(b16))["mode"] == "bf16"
    assert blob_info(round_trips(b16, ref=b16))["mode"] == "delta_bf16"


def test_size_limit_is_inclusive(monkeypatch):
    monkeypatch.setattr(codec, "_MAX_ENTRIES", 64)
    round_trips(np.zeros(64, np.float32))
    round_trips(np.zeros((8, 8), np.float32))
    assert refused(encode_row, np.zeros(65, np.float32), record=REC) == (
        AT + "row too large (65 entries)")
    assert refused(encode_row, np.zeros((5, 13), np.float16)) == (
        "logits blob: row too large (65 entries)")


# ------------------------------------------------------------------ the ref

def test_refused_refs_with_their_exact_messages():
    row = np.zeros(4, np.float32)
    cases = [
        ("nope", "ref must be a numpy array, not str"),
        (np.zeros(4, np.float16), "ref has dtype float16, which does not match dtype='float32'"),
        (np.zeros(4, np.int32), "ref has dtype int32, expected float32, float16 or bfloat16 bits"),
        (np.zeros(3, np.float32), "ref has shape (3,), row has shape (4,)"),
        (np.zeros((2, 2), np.float32), "ref has shape (2, 2), row has shape (4,)"),
    ]
    for ref, what in cases:
        assert refused(encode_row, row, ref=ref, record=REC) == AT + what
        assert refused(encode_row, row, ref=ref) == "logits blob: " + what


def test_the_ref_checksum_field_is_zero_unless_the_blob_is_a_delta():
    row = exponent_heavy_row(3000)
    assert ref_crc_field(encode_row(row)) == 0
    near = row.copy()
    near[::7] = -near[::7]
    delta = round_trips(row, ref=near)
    assert blob_info(delta)["mode"] == "delta_bf16"
    assert ref_crc_field(delta) == zlib.crc32((near.view(np.uint32) >> 16).astype(np.uint16))


def test_a_ref_that_saves_nothing_is_dropped_even_on_a_tie():
    """Random bfloat16 row and ref of 2048 entries: standalone and delta both store two raw
    planes of 2048 bytes. On the tie the row is stored standalone (decodable without the ref)."""
    rng = np.random.default_rng(11)
    row = rng.integers(0, 1 << 16, 2048).astype(np.uint16)
    ref = rng.integers(0, 1 << 16, 2048).astype(np.uint16)
    blob = encode_row(row, ref=ref, dtype="bfloat16")
    info = blob_info(blob)
    assert info["mode"] == "plain" and not info["needs_ref"] and info["ref_crc32"] is None
    assert info["planes"] == ["raw", "raw"] and ref_crc_field(blob) == 0
    assert blob == encode_row(row, dtype="bfloat16")
    assert decode_row(blob).tobytes() == row.tobytes()


def _ref_for_zigzag(row_bits: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The ref whose zigzag delta against ``row_bits`` is ``z`` (z even: +z/2, odd: -(z+1)/2)."""
    z = z.astype(np.int64)
    d = np.where(z & 1, -((z + 1) // 2), z // 2)
    width = row_bits.dtype.itemsize * 8
    return ((row_bits.astype(np.int64) - d) % (1 << width)).astype(row_bits.dtype)


def test_a_delta_of_at_most_one_byte_per_16_bits_is_kept_without_a_comparison():
    """The shortcut: a delta payload of at most n bytes (bf16 packing) or 2n bytes (32-bit delta)
    is kept as it is, even where the standalone row (here a constant) would be far smaller."""
    rng = np.random.default_rng(4)
    n = 2048
    # 32-bit delta: zigzag values below 2**16, two raw planes, exactly 2n bytes
    row32 = np.full(n, 0x3F8CCCCD, np.uint32)  # 1.1f: not bf16-exact, mode plain
    ref32 = _ref_for_zigzag(row32, rng.integers(0, 1 << 16, n))
    blob = round_trips(row32.view(np.float32), ref=ref32.view(np.float32))
    info = blob_info(blob)
    assert info["mode"] == "delta" and info["planes"] == ["raw", "raw", "zero", "zero"]
    assert sum(len(p) for _, p in planes_of(blob)) == 2 * n
    assert ref_crc_field(blob) == zlib.crc32(ref32.tobytes())
    assert len(encode_row(row32.view(np.float32))) < 200  # what standalone would have cost
    # 16-bit delta (bfloat16 bits): zigzag values below 2**8, one raw plane, exactly n bytes
    row16 = np.full(n, 0x3F8C, np.uint16)
    ref16 = _ref_for_zigzag(row16, rng.integers(0, 1 << 8, n))
    blob = round_trips(row16, ref=ref16, dtype="bfloat16")
    info = blob_info(blob)
    assert info["mode"] == "delta" and info["planes"] == ["raw", "zero"]
    assert sum(len(p) for _, p in planes_of(blob)) == n
    assert len(encode_row(row16, dtype="bfloat16")) < 200


# ------------------------------------------------------------------ plane methods

def test_entropy_test_decides_raw_from_1024_bytes_on():
    """A low plane of a permutation of 0..255, repeated: a flat histogram (8 bits per byte), yet
    zstd could shrink it (the repeats). From 1024 bytes on the entropy test stores it raw without
    trying zstd; below, zstd is tried and wins."""
    perm = np.random.default_rng(8).permutation(256).astype(np.uint8)
    for n, want in ((1024, "raw"), (1025, "raw"), (1023, "zstd")):
        lo = np.resize(perm, n)
        bits = bf16_bits(lo, 0x3F)
        blob = round_trips(bits, dtype="bfloat16")
        assert blob_info(blob)["planes"] == [want, "zstd"], n
        if want == "raw":
            assert planes_of(blob)[0] == (0, lo.tobytes())


def test_a_plane_exactly_at_the_entropy_threshold_still_tries_zstd(monkeypatch):
    """Raw without trying zstd only *above* the threshold. No plane's sampled entropy is exactly
    7.6 bits, so the threshold is set to 8.0, which a flat histogram reaches exactly (256 values,
    p = 1/256 each, a sum of exact powers of two): 0..255 four times is tried, and zstd wins."""
    lo = np.tile(np.arange(256, dtype=np.uint8), 4)
    assert codec._entropy_bits(lo) == 8.0
    monkeypatch.setattr(codec, "_RAW_ENTROPY_BITS", 8.0)
    blob = round_trips(bf16_bits(lo, 0x3F), dtype="bfloat16")
    assert blob_info(blob)["planes"] == ["zstd", "zstd"]


def test_a_zstd_frame_no_shorter_than_the_plane_is_not_used():
    """zstd is kept only when it is strictly shorter than the plane: at equal length the plane is
    stored raw (same size, nothing to decompress)."""
    n = 300  # short: zstd's own raw-block fallback leaves frames of n and n - 1 bytes possible
    rng = np.random.default_rng(0)
    base = rng.integers(1, 17, n).astype(np.uint8)  # 4 bits of entropy per byte
    noise = rng.integers(1, 256, n).astype(np.uint8)
    comp = codec._compressor(1)
    found = {}
    for k in range(n + 1):  # the first k bytes noise: the frame grows with k
        lo = base.copy()
        lo[:k] = noise[:k]
        found.setdefault(len(comp.compress(lo)) - n, lo)
        if 0 in found and -1 in found:
            break
    assert 0 in found and -1 in found
    equal = encode_row(bf16_bits(found[0]), dtype="bfloat16")
    assert blob_info(equal)["planes"] == ["raw", "zero"]
    assert planes_of(equal)[0] == (0, found[0].tobytes())
    shorter = encode_row(bf16_bits(found[-1]), dtype="bfloat16")
    assert blob_info(shorter)["planes"] == ["zstd", "zero"]
    assert len(planes_of(shorter)[0][1]) == n - 1
    for blob, lo in ((equal, found[0]), (shorter, found[-1])):
        assert decode_row(blob).tobytes() == bf16_bits(lo).tobytes()


def _plane_with_nonzeros(n: int, nz: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lo = np.zeros(n, np.uint8)
    lo[rng.choice(n, nz, replace=False)] = rng.integers(1, 256, nz)
    return lo


@pytest.mark.parametrize("n, nz, want", [
    (4096, 31, "zstd"),      # below 1/128 nonzero: plain zstd (long zero runs)
    (4096, 32, "sparse"),    # exactly 1/128
    (4096, 1000, "sparse"),
    (4096, 2048, "sparse"),  # exactly half
    (4096, 2049, "zstd"),    # more than half
    (4095, 1000, "zstd"),    # planes of fewer than 4096 bytes are never sparse
    (4095, 32, "zstd"),
    (300, 100, "zstd"),
])
def test_sparse_planes_at_the_edges_of_the_rule(n, nz, want):
    lo = _plane_with_nonzeros(n, nz, seed=nz + n)
    bits = bf16_bits(lo)
    blob = round_trips(bits, dtype="bfloat16")
    assert blob_info(blob)["planes"] == [want, "zero"]
    method, payload = planes_of(blob)[0]
    if want == "sparse":
        count, bm_method, bm_len, v_method = struct.unpack_from("<IBIB", payload)
        assert (method, count) == (3, nz) and bm_method in (0, 1) and v_method in (0, 1)
        bitmap = payload[10: 10 + bm_len]
        if bm_method == 1:
            bitmap = zstandard.ZstdDecompressor().decompress(bitmap, max_output_size=n)
        assert bitmap == np.packbits(lo != 0).tobytes()
