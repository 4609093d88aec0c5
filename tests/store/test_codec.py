"""Lossless logits codec: bit-exact round trips, delta mode, corruption detection."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tensorverse.store.codec import (
    CodecError,
    blob_info,
    decode_row,
    encode_row,
    row_checksum,
)

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

UINT = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
FLOAT = {"float32": np.float32, "float16": np.float16}


def bits_of(a: np.ndarray) -> np.ndarray:
    """Bit patterns of a float array (compare these, never values: NaN != NaN)."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return a
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def make_row(bits: np.ndarray, dtype: str) -> tuple[np.ndarray, dict]:
    """(row to encode, encode kwargs) from raw bit patterns."""
    if dtype == "bfloat16":
        return bits.astype(np.uint16), {"dtype": "bfloat16"}
    return bits.view(FLOAT[dtype]), {}


def assert_round_trip(row: np.ndarray, ref: np.ndarray | None = None, **kw) -> bytes:
    blob = encode_row(row, ref=ref, **kw)
    out = decode_row(blob, ref=ref)
    assert out.shape == row.shape
    assert out.dtype == (np.uint16 if kw.get("dtype") == "bfloat16" else row.dtype)
    np.testing.assert_array_equal(bits_of(out), bits_of(row))
    return blob


def logits_like(n: int, seed: int = 0, bf16: bool = True) -> np.ndarray:
    """A small realistic row: Gaussian logits, optionally rounded to bf16-exact float32."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 2.0 - 1.0).astype(np.float32)
    if bf16:
        x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return x


def near(row: np.ndarray, seed: int = 1, share: float = 0.3) -> np.ndarray:
    """A near-identical row: some entries moved by an ulp or two (bit pattern +-1/2)."""
    rng = np.random.default_rng(seed)
    u = row.view(np.uint32) if row.dtype == np.float32 else row.view(np.uint16)
    step = np.uint32(1 << 16) if row.dtype == np.float32 and not (u & 0xFFFF).any() else 1
    moved = u.copy()
    pick = rng.random(u.size) < share
    k = int(pick.sum())
    up = rng.random(k) < 0.5
    vals = moved[pick]
    vals[up] += np.asarray(step, vals.dtype)
    vals[~up] -= np.asarray(step, vals.dtype)
    moved[pick] = vals
    return moved.view(row.dtype)


# ------------------------------------------------------------------ property round trips

@FAST
@given(hnp.arrays(np.uint32, st.integers(0, 600)))
def test_float32_any_bits_round_trip(bits):
    assert_round_trip(bits.view(np.float32))


@FAST
@given(hnp.arrays(np.uint16, st.integers(0, 600)))
def test_float16_any_bits_round_trip(bits):
    assert_round_trip(bits.view(np.float16))


@FAST
@given(hnp.arrays(np.uint16, st.integers(0, 600)))
def test_bfloat16_any_bits_round_trip(bits):
    blob = assert_round_trip(bits, dtype="bfloat16")
    assert blob_info(blob)["dtype"] == "bfloat16"
    out = decode_row(encode_row(bits.view(np.int16), dtype="bfloat16"))  # torch int16 view
    np.testing.assert_array_equal(out, bits)


@FAST
@given(hnp.arrays(np.uint16, st.integers(0, 600)))
def test_bf16_exact_float32_any_bits(hi):
    row = (hi.astype(np.uint32) << 16).view(np.float32)
    blob = assert_round_trip(row)
    assert blob_info(blob)["mode"] == "bf16"


@FAST
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
                max_size=300))
def test_float32_values_round_trip(vals):
    assert_round_trip(np.array(vals, dtype=np.float32))


ADVERSARIAL32 = np.array([
    0x00000000, 0x80000000,              # +0.0, -0.0
    0x7F800000, 0xFF800000,              # +inf, -inf
    0x7FC00000, 0xFFC00000,              # quiet NaNs
    0x7F800001, 0x7FA5A5A5, 0xFF812345,  # signalling NaN / payloads
    0x7FFFFFFF, 0xFFFFFFFF,              # all-ones NaN
    0x00000001, 0x80000001, 0x007FFFFF,  # subnormals
    0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # min normal, max, lowest
    0x3F800000, 0xBF800000,              # +-1
], dtype=np.uint32)
ADVERSARIAL16 = np.array([
    0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7D5A, 0xFFFF, 0x7FFF,
    0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00,
], dtype=np.uint16)
ADVERSARIAL_BF16 = np.array([
    0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FA5, 0xFFFF, 0x7FFF,
    0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80,
], dtype=np.uint16)


@pytest.mark.parametrize("n", [1, 19, 5000])
def test_adversarial_values(n):
    rng = np.random.default_rng(n)
    b32 = np.resize(ADVERSARIAL32, n)
    assert_round_trip(b32.view(np.float32))
    assert_round_trip(rng.permutation(b32).view(np.float32))
    assert_round_trip(np.resize(ADVERSARIAL16, n).view(np.float16))
    assert_round_trip(np.resize(ADVERSARIAL_BF16, n), dtype="bfloat16")
    # bf16-exact float32 with NaN payloads / inf / -0.0 in the high half
    hi = np.resize(ADVERSARIAL_BF16, n).astype(np.uint32) << 16
    blob = assert_round_trip(hi.view(np.float32))
    assert blob_info(blob)["mode"] == "bf16"


@FAST
@given(hnp.arrays(np.uint32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=40)))
def test_2d_round_trip(bits):
    blob = assert_round_trip(bits.view(np.float32))
    assert blob_info(blob)["shape"] == bits.shape
    assert_round_trip(bits.view(np.float32), ref=(bits ^ np.uint32(1)).view(np.float32))


def test_empty_and_single_entry():
    for dt in ("float32", "float16", "bfloat16"):
        for n in (0, 1):
            row, kw = make_row(np.arange(n, dtype=UINT[dt]) + 0x3C00, dt)
            blob = assert_round_trip(row, **kw)
            assert blob_info(blob)["entries"] == n
            assert_round_trip(row, ref=row.copy(), **kw)


def test_non_contiguous_and_big_endian_inputs():
    row = logits_like(4000, bf16=False)
    assert_round_trip(row[::2].copy())
    out = decode_row(encode_row(row[::2]))
    np.testing.assert_array_equal(bits_of(out), bits_of(row[::2].copy()))
    big = row.astype(">f4")
    out = decode_row(encode_row(big))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(bits_of(out), bits_of(row))


# ------------------------------------------------------------------ bf16 detection, sizes

def test_bf16_exact_detection_and_size():
    row = logits_like(151_936)
    blob = assert_round_trip(row)
    info = blob_info(blob)
    assert info["mode"] == "bf16"
    assert info["bytes_per_entry"] <= 2.0
    assert len(blob) / row.size <= 1.6  # Gaussian logits: exponent plane compresses
    # one stray low bit makes it a full float32 row, still exact
    row2 = row.copy()
    row2.view(np.uint32)[1234] |= 1
    blob2 = assert_round_trip(row2)
    assert blob_info(blob2)["mode"] == "plain"


def test_bf16_float32_matches_bfloat16_fingerprint():
    row = logits_like(3000)
    hi = (row.view(np.uint32) >> 16).astype(np.uint16)
    assert blob_info(encode_row(row))["crc32"] == blob_info(
        encode_row(hi, dtype="bfloat16"))["crc32"] == row_checksum(row)


def test_identical_delta_row_is_tiny():
    row = logits_like(151_936)
    blob = assert_round_trip(row.copy(), ref=row)
    assert len(blob) < 100
    info = blob_info(blob)
    assert info["needs_ref"] and info["mode"] == "delta_bf16"
    assert info["ref_crc32"] == blob_info(encode_row(row))["crc32"]
    full = logits_like(151_936, bf16=False)
    assert len(assert_round_trip(full.copy(), ref=full)) < 100


@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16", "float32-full"])
def test_delta_near_identical(dt):
    n = 20_000
    if dt == "float32":
        ref = logits_like(n)
    elif dt == "float32-full":
        ref = logits_like(n, bf16=False)
    elif dt == "float16":
        ref = logits_like(n, bf16=False).astype(np.float16)
    else:
        ref = (logits_like(n).view(np.uint32) >> 16).astype(np.uint16)
    kw = {"dtype": "bfloat16"} if dt == "bfloat16" else {}
    row = near(ref)
    blob = assert_round_trip(row, ref=ref, **kw)
    info = blob_info(blob)
    assert info["needs_ref"]
    assert len(blob) < 0.5 * len(encode_row(row, **kw))


def test_delta_totally_different_ref_falls_back():
    row, other = logits_like(20_000, seed=1), logits_like(20_000, seed=2)
    blob = assert_round_trip(row, ref=other)
    assert len(blob) <= len(encode_row(row)) + 64
    # random bits as ref: still lossless whichever mode wins
    rng = np.random.default_rng(3)
    junk = rng.integers(0, 2**32, 20_000, dtype=np.uint32).view(np.float32)
    assert_round_trip(row, ref=junk)
    assert_round_trip(junk, ref=row)


@FAST
@given(hnp.arrays(np.uint32, st.integers(1, 300)), st.data())
def test_delta_any_bits(bits, data):
    ref_bits = data.draw(hnp.arrays(np.uint32, bits.shape))
    mix = data.draw(hnp.arrays(np.bool_, bits.shape))
    row = np.where(mix, ref_bits, bits)  # partly identical
    assert_round_trip(row.view(np.float32), ref=ref_bits.view(np.float32))
    # bf16-exact pair
    r16, b16 = (row & np.uint32(0xFFFF0000)), (ref_bits & np.uint32(0xFFFF0000))
    assert_round_trip(r16.view(np.float32), ref=b16.view(np.float32))
    assert_round_trip(r16.view(np.float32), ref=ref_bits.view(np.float32))
    assert_round_trip(row.view(np.float32), ref=b16.view(np.float32))


def test_wrong_or_missing_ref_raises():
    ref = logits_like(10_000)
    row = near(ref)
    blob = encode_row(row, ref=ref, record="s1/t0/p5")
    assert blob_info(blob)["needs_ref"]
    with pytest.raises(CodecError, match="ref"):
        decode_row(blob, record="s1/t0/p5")
    with pytest.raises(CodecError, match="s1/t0/p5"):
        decode_row(blob, ref=near(ref, seed=9), record="s1/t0/p5")
    with pytest.raises(CodecError):
        decode_row(blob, ref=ref[:-1])
    with pytest.raises(CodecError):
        decode_row(blob, ref=ref.astype(np.float16))
    # a standalone blob ignores a ref
    plain = encode_row(row)
    np.testing.assert_array_equal(bits_of(decode_row(plain, ref=near(ref, 5))), bits_of(row))


def test_ref_shape_or_dtype_mismatch_on_encode():
    row = logits_like(100)
    with pytest.raises(CodecError, match="shape"):
        encode_row(row, ref=row[:50])
    with pytest.raises(CodecError):
        encode_row(row, ref=row.astype(np.float16))


# ------------------------------------------------------------------ corruption

def _corruptions_raise(blob: bytes, positions, record="rec-7") -> None:
    for pos in positions:
        for delta in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[pos] ^= delta
            with pytest.raises(CodecError, match=record):
                decode_row(bytes(bad), ref=None, record=record)


def test_every_single_byte_corruption_small_blob():
    row = logits_like(300, bf16=False)
    blob = encode_row(row)
    _corruptions_raise(blob, range(len(blob)))
    tiny = encode_row(logits_like(1))
    _corruptions_raise(tiny, range(len(tiny)))


@pytest.mark.parametrize("kind", ["bf16", "plain", "float16", "delta"])
def test_sampled_corruption_and_truncation(kind):
    n = 12_000
    ref = logits_like(n)
    if kind == "bf16":
        blob, r = encode_row(ref), None
    elif kind == "plain":
        blob, r = encode_row(logits_like(n, bf16=False)), None
    elif kind == "float16":
        blob, r = encode_row(ref.astype(np.float16)), None
    else:
        blob, r = encode_row(near(ref), ref=ref), ref
        assert blob_info(blob)["needs_ref"]
    rng = np.random.default_rng(0)
    head = list(range(min(80, len(blob))))
    positions = head + list(rng.integers(0, len(blob), 60)) + [len(blob) - 1]
    for pos in positions:
        bad = bytearray(blob)
        bad[pos] ^= int(rng.integers(1, 256))
        with pytest.raises(CodecError, match="rec-9"):
            decode_row(bytes(bad), ref=r, record="rec-9")
        with pytest.raises(CodecError):
            blob_info(bytes(bad))
    for cut in [0, 1, 3, 4, 10, 20, 40, len(blob) // 2, len(blob) - 4, len(blob) - 1,
                *rng.integers(0, len(blob), 10)]:
        with pytest.raises(CodecError, match="rec-9"):
            decode_row(blob[:cut], ref=r, record="rec-9")
    with pytest.raises(CodecError):
        decode_row(blob + b"\0", ref=r)


def test_crafted_blob_with_valid_crc_is_still_checked():
    """A forged blob whose outer crc is right but whose contents lie must still fail."""
    row = logits_like(5000)
    blob = bytearray(encode_row(row))
    blob[8] ^= 0x55  # row checksum field
    body = bytes(blob[:-4])
    forged = body + zlib.crc32(body).to_bytes(4, "little")
    with pytest.raises(CodecError, match="checksum"):
        decode_row(forged)


def test_not_a_blob():
    for junk in (b"", b"TVLG", b"hello world, this is not a logits blob at all......", 42):
        with pytest.raises(CodecError):
            decode_row(junk)  # type: ignore[arg-type]


# ------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("bad", [
    np.arange(10, dtype=np.int64),
    np.array([1.0, 2.0], dtype=object),
    np.zeros(10, dtype=np.float64),
    np.zeros(10, dtype=np.uint16),          # bf16 bits without dtype="bfloat16"
    np.zeros(10, dtype=np.int16),
    np.zeros(10, dtype=bool),
    np.float32(1.0),                        # 0-d
    "not an array",
])
def test_wrong_input_raises_clear_error(bad):
    with pytest.raises(CodecError, match="dtype|dimensions|array"):
        encode_row(bad)


def test_dtype_flag_mismatch_and_bad_level():
    with pytest.raises(CodecError, match="dtype"):
        encode_row(np.zeros(4, np.float32), dtype="bfloat16")
    with pytest.raises(CodecError, match="dtype"):
        encode_row(np.zeros(4, np.float32), dtype="float64")
    with pytest.raises(CodecError, match="level"):
        encode_row(np.zeros(4, np.float32), level=99)
    assert_round_trip(logits_like(5000), level=9)
    assert_round_trip(logits_like(5000), level=-3)


def test_blob_info_fields():
    row = logits_like(4096)
    blob = encode_row(row)
    info = blob_info(memoryview(blob))
    assert info["dtype"] == "float32" and info["shape"] == (4096,)
    assert info["mode"] == "bf16" and info["nbytes"] == len(blob)
    assert info["raw_nbytes"] == 4096 * 4 and info["version"] == 1
    assert info["ref_crc32"] is None and not info["needs_ref"]
    # decode accepts memoryview and bytearray too
    for b in (memoryview(blob), bytearray(blob)):
        np.testing.assert_array_equal(bits_of(decode_row(b)), bits_of(row))


def test_threads():
    rows = [logits_like(20_000, seed=s) for s in range(4)]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                r = rows[i]
                assert_round_trip(near(r, seed=i), ref=r)
                assert_round_trip(r)
        except Exception as e:  # pragma: no cover - reported below  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_masked_and_constant_rows():
    n = 151_936
    row = np.full(n, -np.inf, np.float32)
    row[42] = 3.5
    blob = assert_round_trip(row)
    assert len(blob) < 1000
    assert_round_trip(np.zeros(n, np.float32))
    assert_round_trip(np.full(n, np.nan, np.float32))


# -- refusals' messages, bfloat16 checksums, float16 and bfloat16 matrices, the entropy estimate --

def test_errors_name_the_blob_when_no_record_is_given():
    from tensorverse.store.codec import CodecError, decode_row

    with pytest.raises(CodecError, match="^logits blob: "):
        decode_row(b"not a blob at all, long enough to parse")
    with pytest.raises(CodecError, match="^logits record 'r@3': "):
        decode_row(b"not a blob at all, long enough to parse", record="r@3")


def test_row_checksum_of_bfloat16_bits_is_the_blob_fingerprint():
    from tensorverse.store.codec import blob_info, encode_row, row_checksum

    bits = (np.arange(64, dtype=np.uint16) * 977) & 0x7F7F
    assert row_checksum(bits, dtype="bfloat16") == blob_info(encode_row(bits, dtype="bfloat16"))["crc32"]
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    assert row_checksum(widened) == row_checksum(bits, dtype="bfloat16")  # the same row, either form


def test_matrices_of_float16_and_bfloat16_keep_their_shape():
    from tensorverse.store.codec import decode_row, encode_row

    h = (np.arange(24, dtype=np.float32) / 7).astype(np.float16).reshape(4, 6)
    back = decode_row(encode_row(h))
    assert back.shape == (4, 6) and back.dtype == np.float16 and back.tobytes() == h.tobytes()
    b = ((np.arange(24, dtype=np.uint16) * 311) & 0x7F7F).reshape(3, 8)
    back = decode_row(encode_row(b, dtype="bfloat16"))
    assert back.shape == (3, 8) and back.dtype == np.uint16 and back.tobytes() == b.tobytes()


def test_entropy_estimate_of_a_plane():
    """The raw-or-zstd test's estimate (bits per byte): a plane longer than the sample is read at a
    stride of len // 4096, so an alternating plane of 8192 bytes reads as constant; shorter planes are
    read whole. (A wrong estimate costs bytes or time, never correctness: planes are lossless.)"""
    from tensorverse.store.codec import _SAMPLE, _entropy_bits

    alt = np.tile(np.array([0, 255], np.uint8), 4096)
    assert _entropy_bits(alt[:4098]) == 1.0  # 4098 < 2 * 4096: stride 1
    assert _entropy_bits(alt[: 2 * _SAMPLE]) == 0.0  # stride 2: every other byte
    assert _entropy_bits(np.full(100, 7, np.uint8)) == 0.0
    assert _entropy_bits(np.arange(256, dtype=np.uint8)) == 8.0
    rng = np.random.default_rng(0)
    assert 7.9 < _entropy_bits(rng.integers(0, 256, 100_000, dtype=np.uint8)) <= 8.0


def test_each_inner_check_names_the_record_and_the_reason():
    """Blobs whose trailing checksum is valid but whose insides are wrong: each check raises with
    the record's name and its own reason (the trailing checksum alone would not say what)."""
    import struct

    from tensorverse.store.codec import CodecError, decode_row, encode_row

    def sealed(b: bytes) -> bytes:
        return b[:-4] + struct.pack("<I", zlib.crc32(b[:-4]))

    rng = np.random.default_rng(3)
    x = (rng.standard_normal(64) * 3).astype(np.float32)
    good = encode_row(x)
    planes_at = 16 + 8 * 1 + 1  # header, one dimension, the plane count
    cases = [
        (sealed(b"XXXX" + good[4:]), "not a logits blob \\(bad magic\\)"),
        (sealed(good[:4] + b"\x07" + good[5:]), "unsupported codec version 7 \\(this is 1\\)"),
        (sealed(good[:8] + struct.pack("<I", 12345) + good[12:]), "decoded row checksum mismatch"),
        (sealed(good[:planes_at] + b"\x09" + good[planes_at + 1:]), "plane 0: unknown method 9"),
    ]
    for blob, reason in cases:
        with pytest.raises(CodecError, match=f"^logits record 'R@1': {reason}"):
            decode_row(blob, record="R@1")
    ref = x.copy()
    ref[3] += 1
    delta = encode_row(x, ref=ref)
    with pytest.raises(CodecError, match="^logits record 'R@2': blob is delta-encoded against a reference row; pass ref="):
        decode_row(delta, record="R@2")
    with pytest.raises(CodecError, match="^logits record 'R@2': ref does not match the row this blob was encoded against"):
        decode_row(delta, ref=x, record="R@2")
    with pytest.raises(CodecError, match="^logits record 'R@2': ref has shape \\(3,\\), blob has shape \\(64,\\)"):
        decode_row(delta, ref=ref[:3], record="R@2")
    with pytest.raises(CodecError, match="^logits record 'R@3': blob must be bytes, not int"):
        decode_row(7, record="R@3")
