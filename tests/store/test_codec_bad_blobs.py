"""The decoder against blobs built by hand from the documented layout (store/codec.py's docstring).

Every blob here is sealed with a valid trailing checksum, so it gets past the first check and
meets the one under test: each header bound exactly at its edge, each plane method's framing
(raw, zstd, zero, sparse), each check of a ref, and the whole message of every refusal, record
included. Nothing is built with the codec's own packing code: the header is `struct.pack` of the
documented fields, the planes are byte i of each little-endian entry, written out.
"""

from __future__ import annotations

import pickle
import struct
import zlib

import numpy as np
import pytest
import zstandard

from tensorverse.store.codec import REASONS, CodecError, blob_info, decode_row, encode_row

F32, BF16, F16 = 1, 2, 3  # dtype codes
PLAIN, BF16_MODE, DELTA, DELTA_BF16 = 0, 1, 2, 3  # mode codes
RAW, ZSTD, ZERO, SPARSE = 0, 1, 2, 3  # plane methods
REC = "rec-7"


def sealed(body: bytes) -> bytes:
    """A blob body plus its trailing crc32 (little-endian)."""
    return body + struct.pack("<I", zlib.crc32(body))


def body(planes, *, shape=(4,), dtype=F32, mode=PLAIN, crc_row=0, crc_ref=0, version=1,
         ndim=None, k=None, extra=b"") -> bytes:
    """The documented layout: header, shape, plane count, plane table, payloads."""
    ndim = len(shape) if ndim is None else ndim
    head = struct.pack("<4sBBBBII", b"TVLG", version, dtype, mode, ndim, crc_row, crc_ref)
    dims = struct.pack("<%dQ" % len(shape), *shape)
    table = b"".join(struct.pack("<BI", m, len(p)) for m, p in planes)
    count = bytes((len(planes) if k is None else k,))
    return head + dims + count + table + b"".join(p for _, p in planes) + extra


def blob(planes, **kw) -> bytes:
    return sealed(body(planes, **kw))


def refused(b, reason: str, *, record: str = REC, ref=None) -> None:
    """decode_row refuses ``b`` with exactly this message."""
    with pytest.raises(CodecError) as e:
        decode_row(b, ref=ref, record=record)
    where = f"logits record {record!r}" if record else "logits blob"
    assert str(e.value) == f"{where}: {reason}"


# A four-entry float32 row (1.0, 0.0, 2.0, -1.0) and its byte planes, written out.
ROW = np.array([0x3F800000, 0, 0x40000000, 0xBF800000], "<u4")
ROW_CRC = zlib.crc32(ROW.tobytes())
ROW_PLANES = [(ZERO, b""), (ZERO, b""), (RAW, bytes([0x80, 0, 0, 0x80])),
              (RAW, bytes([0x3F, 0, 0x40, 0xBF]))]


def good_blob(**kw) -> bytes:
    return blob(ROW_PLANES, crc_row=ROW_CRC, **kw)


def test_the_hand_built_blob_decodes_and_its_info_is_whole():
    out = decode_row(good_blob())
    assert out.dtype == np.float32 and out.view("<u4").tolist() == ROW.tolist()
    b = good_blob()
    assert blob_info(b) == {
        "version": 1, "dtype": "float32", "shape": (4,), "mode": "plain", "needs_ref": False,
        "nbytes": len(b), "entries": 4, "raw_nbytes": 16, "bytes_per_entry": len(b) / 4,
        "crc32": ROW_CRC, "ref_crc32": None, "planes": ["zero", "zero", "raw", "raw"]}


def test_blob_info_names_the_record_or_the_blob():
    bad = bytearray(good_blob())
    bad[-1] ^= 1  # the trailing checksum no longer matches
    bad = bytes(bad)
    with pytest.raises(CodecError) as e:
        blob_info(bad, record=REC)
    assert str(e.value) == "logits record 'rec-7': blob checksum mismatch (corrupt or truncated)"
    with pytest.raises(CodecError) as e:
        blob_info(bad)
    assert str(e.value) == "logits blob: blob checksum mismatch (corrupt or truncated)"


# ------------------------------------------------------------------ buffers of other shapes

def _blob_of_length_divisible_by(m: int) -> tuple[bytes, np.ndarray]:
    for n in range(1, 200):
        row = np.arange(n, dtype=np.float32) * np.float32(1.25)
        b = encode_row(row)
        if len(b) % m == 0:
            return b, row
    raise AssertionError("no blob length is a multiple of %d" % m)


@pytest.mark.parametrize("view", ["2-D bytes", "uint16", "uint32"])
def test_any_contiguous_buffer_is_read_as_its_bytes(view):
    b, row = _blob_of_length_divisible_by(4)
    u8 = np.frombuffer(b, np.uint8)
    arr = {"2-D bytes": u8.reshape(4, -1), "uint16": u8.view(np.uint16),
           "uint32": u8.view(np.uint32)}[view]
    mv = memoryview(arr)
    assert mv.ndim != 1 or mv.itemsize != 1
    assert decode_row(mv).tobytes() == row.tobytes()
    assert blob_info(mv)["shape"] == row.shape


def test_a_byte_above_127_in_a_multi_dimensional_buffer_is_read_unsigned():
    b = blob(ROW_PLANES, crc_row=ROW_CRC, k=200)  # the plane count is read by index
    for buf in (b, memoryview(np.frombuffer(b, np.uint8).reshape(1, -1))):
        refused(buf, "200 byte planes for dtype float32, mode plain (expected 4)")


def test_a_non_contiguous_buffer_is_refused_by_name():
    b = good_blob()
    strided = np.frombuffer(b * 2, np.uint8).reshape(2, -1)[:, ::2]
    with pytest.raises(CodecError) as e:
        decode_row(memoryview(strided), record=REC)
    assert str(e.value).startswith(
        "logits record 'rec-7': blob buffer is not contiguous bytes: ")
    assert str(e.value) != "logits record 'rec-7': blob buffer is not contiguous bytes: "


# ------------------------------------------------------------------ header bounds

def test_the_smallest_blob_is_29_bytes():
    # 16 header + 8 for one dimension + 1 plane count + 4 checksum
    b29 = blob([], k=0)
    assert len(b29) == 29
    refused(b29, "0 byte planes for dtype float32, mode plain (expected 4)")
    refused(b29[:28], "blob truncated (28 bytes, a blob has at least 29)")
    refused(b"TVLG", "blob truncated (4 bytes, a blob has at least 29)")


def test_checksum_dtype_mode_and_ndim_refusals_whole():
    b = bytearray(good_blob())
    b[-1] ^= 1
    refused(bytes(b), "blob checksum mismatch (corrupt or truncated)")
    refused(good_blob(dtype=9), "unknown dtype code 9")
    refused(good_blob(mode=7), "unknown mode code 7")
    refused(blob([], shape=(4,), ndim=9), "bad ndim 9")
    refused(blob([], shape=(4,), ndim=0), "bad ndim 0")
    refused(good_blob(dtype=F16, mode=BF16_MODE), "mode bf16 with dtype float16")
    refused(good_blob(dtype=BF16, mode=DELTA_BF16), "mode delta_bf16 with dtype bfloat16")
    refused(blob(ROW_PLANES[:3], crc_row=ROW_CRC),
            "3 byte planes for dtype float32, mode plain (expected 4)")
    refused(blob(ROW_PLANES, crc_row=ROW_CRC, dtype=F16),
            "4 byte planes for dtype float16, mode plain (expected 2)")
    refused(blob(ROW_PLANES, mode=BF16_MODE), "4 byte planes for dtype float32, mode bf16 (expected 2)")


def test_eight_dimensions_are_allowed():
    row = np.arange(6, dtype=np.float32).reshape(1, 1, 1, 1, 1, 1, 2, 3)
    b = encode_row(row)
    assert blob_info(b)["shape"] == (1, 1, 1, 1, 1, 1, 2, 3)
    assert decode_row(b).shape == row.shape and decode_row(b).tobytes() == row.tobytes()


def test_truncated_in_the_shape_exactly_at_its_edge():
    # two dimensions: 16 + 16 + 1 + 4 = 37 bytes at least
    whole = sealed(body([], shape=(2, 2), k=0))
    assert len(whole) == 37
    refused(whole, "0 byte planes for dtype float32, mode plain (expected 4)")
    short = sealed(body([], shape=(2, 2), k=0)[:-1])
    assert len(short) == 36
    refused(short, "blob truncated in the shape")


def test_the_shape_is_unsigned_and_bounded_at_2_to_the_40():
    zeros = [(ZERO, b"")] * 4
    big = blob(zeros, shape=(1 << 40,), crc_row=0)
    info = blob_info(big)
    assert info["entries"] == 1 << 40 and info["shape"] == (1 << 40,)
    refused(blob(zeros, shape=((1 << 40) + 1,)), "implausible shape (1099511627777,)")
    refused(blob(zeros, shape=(1 << 63,)), "implausible shape (9223372036854775808,)")


def test_truncated_in_the_plane_table_exactly_at_its_edge():
    zeros = [(ZERO, b"")] * 4
    whole = blob(zeros, crc_row=zlib.crc32(bytes(16)))
    assert len(whole) == 16 + 8 + 1 + 4 * 5 + 4 == 49
    assert decode_row(whole).tolist() == [0.0] * 4
    refused(sealed(body(zeros)[:-1]), "blob truncated in the plane table")


def test_plane_table_refusals_whole():
    refused(blob([(ZERO, b""), (ZERO, b"abc"), (ZERO, b""), (ZERO, b"")]),
            "plane 1: zero plane with 3 bytes")
    # table 20 bytes + planes 8 bytes = 28; the body holds one byte more
    refused(good_blob(extra=b"!"), "plane lengths add up to 28 bytes, blob body has 29")


# ------------------------------------------------------------------ dense planes

def _with_plane(i: int, plane) -> bytes:
    planes = list(ROW_PLANES)
    planes[i] = plane
    return blob(planes, crc_row=ROW_CRC)


def test_dense_plane_refusals_whole():
    refused(_with_plane(2, (RAW, b"\x80\x00\x00")), "plane 2: raw data of 3 bytes, expected 4")
    short = zstandard.ZstdCompressor().compress(b"\x80\x00\x00")
    refused(_with_plane(2, (ZSTD, short)), "plane 2: decompressed to 3 bytes, expected 4")
    with pytest.raises(CodecError) as e:
        decode_row(_with_plane(3, (ZSTD, b"not a zstd frame")), record=REC)
    assert str(e.value).startswith("logits record 'rec-7': plane 3: zstd error: ")


def test_a_zstd_frame_without_its_content_size_decodes():
    """Another zstd writer may leave the size out of the frame header: the plane size is known."""
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    frame = cctx.compress(bytes([0x3F, 0, 0x40, 0xBF]))
    assert zstandard.get_frame_parameters(frame).content_size == zstandard.CONTENTSIZE_UNKNOWN
    out = decode_row(_with_plane(3, (ZSTD, frame)))
    assert out.view("<u4").tolist() == ROW.tolist()


# ------------------------------------------------------------------ sparse planes

def sparse(nz: int, bitmap: tuple[int, bytes], values: tuple[int, bytes]) -> tuple[int, bytes]:
    """A sparse plane: <IBIB (count, bitmap method, bitmap length, values method), then both."""
    (bm, bm_data), (vm, v_data) = bitmap, values
    return SPARSE, struct.pack("<IBIB", nz, bm, len(bm_data), vm) + bm_data + v_data


def test_sparse_planes_decode_with_one_and_with_every_entry_nonzero():
    # plane 2 of ROW is 0x80, 0, 0, 0x80: entries 0 and 3 (bitmap 0b1001_0000)
    two = sparse(2, (RAW, bytes([0b10010000])), (RAW, bytes([0x80, 0x80])))
    assert decode_row(_with_plane(2, two)).view("<u4").tolist() == ROW.tolist()
    # one nonzero entry
    row1 = np.array([0, 0, 0x40000000, 0], "<u4")
    one = sparse(1, (RAW, bytes([0b00100000])), (RAW, bytes([0x40])))
    b = blob([(ZERO, b""), (ZERO, b""), (ZERO, b""), one], crc_row=zlib.crc32(row1.tobytes()))
    assert decode_row(b).view("<u4").tolist() == row1.tolist()
    # every entry nonzero: the count equals the plane length
    allnz = sparse(4, (ZSTD, zstandard.ZstdCompressor().compress(bytes([0b11110000]))),
                   (RAW, bytes([0x3F, 0x3F, 0x40, 0xBF])))
    row4 = np.array([0x3F800000, 0x3F000000, 0x40000000, 0xBF800000], "<u4")
    planes = [(ZERO, b""), (ZERO, b""), (RAW, bytes([0x80, 0, 0, 0x80])), allnz]
    assert decode_row(blob(planes, crc_row=zlib.crc32(row4.tobytes()))).view(
        "<u4").tolist() == row4.tolist()


def test_padding_bits_of_a_sparse_bitmap_past_the_plane_are_ignored():
    """The bitmap is np.packbits of the plane's nonzero mask: only its first n bits count."""
    padded = sparse(2, (RAW, bytes([0b10011111])), (RAW, bytes([0x80, 0x80])))
    assert decode_row(_with_plane(2, padded)).view("<u4").tolist() == ROW.tolist()


def test_sparse_plane_refusals_whole():
    values = (RAW, bytes([0x80, 0x80]))
    bitmap = (RAW, bytes([0b10010000]))
    refused(_with_plane(2, (SPARSE, b"\0" * 9)), "plane 2: sparse header truncated")
    # a header and nothing else: the bitmap is missing
    refused(_with_plane(2, (SPARSE, struct.pack("<IBIB", 2, RAW, 0, RAW))),
            "plane 2 bitmap: raw data of 0 bytes, expected 1")
    refused(_with_plane(2, sparse(0, bitmap, values)), "plane 2: bad sparse header")
    refused(_with_plane(2, sparse(5, bitmap, values)), "plane 2: bad sparse header")
    too_long = (SPARSE, struct.pack("<IBIB", 2, RAW, 4, RAW) + bytes([0b10010000, 0x80, 0x80]))
    refused(_with_plane(2, too_long), "plane 2: bad sparse header")
    # the bitmap reaches the end exactly: the values are missing
    exact = (SPARSE, struct.pack("<IBIB", 2, RAW, 1, RAW) + bytes([0b10010000]))
    refused(_with_plane(2, exact), "plane 2 values: raw data of 0 bytes, expected 2")
    refused(_with_plane(2, sparse(2, (ZERO, bytes([0b10010000])), values)),
            "plane 2 bitmap: bad method 2")
    refused(_with_plane(2, sparse(2, bitmap, (7, bytes([0x80, 0x80])))),
            "plane 2 values: bad method 7")
    refused(_with_plane(2, sparse(2, (RAW, bytes([0b10110000])), values)),
            "plane 2: sparse bitmap has 3 entries, header says 2")


# ------------------------------------------------------------------ refs and row checksums

def test_row_checksum_refusals_in_every_mode_whole():
    refused(blob(ROW_PLANES, crc_row=ROW_CRC ^ 1), "decoded row checksum mismatch")
    # ROW is bf16-exact (every low half zero), so its fingerprint is the crc32 of its high
    # halves; a delta of all zero planes against ROW decodes to ROW.
    ref = ROW.view(np.float32)
    bf_crc = zlib.crc32((ROW >> 16).astype("<u2").tobytes())
    zeros4, zeros2 = [(ZERO, b"")] * 4, [(ZERO, b"")] * 2
    out = decode_row(blob(zeros4, mode=DELTA, crc_row=bf_crc, crc_ref=bf_crc), ref=ref)
    assert out.view("<u4").tolist() == ROW.tolist()
    refused(blob(zeros4, mode=DELTA, crc_row=bf_crc ^ 1, crc_ref=bf_crc),
            "decoded row checksum mismatch", ref=ref)
    refused(blob(zeros2, mode=DELTA_BF16, crc_row=bf_crc ^ 1, crc_ref=bf_crc),
            "decoded row checksum mismatch", ref=ref)
    out = decode_row(blob(zeros2, mode=DELTA_BF16, crc_row=bf_crc, crc_ref=bf_crc), ref=ref)
    assert out.view("<u4").tolist() == ROW.tolist()


def test_a_bf16_delta_against_a_ref_that_is_not_bf16_exact_is_refused():
    ref = np.array([0x3F800001, 0, 0, 0], "<u4")  # a low bit set: full float32
    b = blob([(ZERO, b"")] * 2, mode=DELTA_BF16, crc_row=0,
             crc_ref=zlib.crc32(ref.tobytes()))
    refused(b, "ref is not bf16-exact but the blob is a bf16 delta", ref=ref.view(np.float32))


def test_ref_refusals_name_the_ref_and_the_record():
    x = np.arange(512, dtype=np.float32) * np.float32(0.75)
    ref = x.copy()
    ref[2] = np.float32(9.5)
    d = encode_row(x, ref=ref)
    assert blob_info(d)["needs_ref"]
    refused(d, "ref must be a numpy array, not str", ref="ref")
    refused(d, "ref has dtype float16, which does not match dtype='float32'",
            ref=ref.astype(np.float16))
    refused(d, "ref does not match the row this blob was encoded against "
               "(ref checksum mismatch)", ref=x)


def test_a_bf16_delta_matrix_keeps_its_shape():
    rng = np.random.default_rng(5)
    ref = (rng.standard_normal((3, 64)).astype(np.float32).view("<u4") & 0xFFFF0000).view(
        np.float32)
    row = ref.copy()
    row[1, 7] = -row[1, 7]
    b = encode_row(row, ref=ref)
    assert blob_info(b)["mode"] == "delta_bf16"
    out = decode_row(b, ref=ref)
    assert out.shape == (3, 64) and out.tobytes() == row.tobytes()


def test_plane_errors_name_their_plane_and_the_record_or_the_blob():
    bad = _with_plane(3, (RAW, b"\x3f"))
    refused(bad, "plane 3: raw data of 1 bytes, expected 4")
    refused(bad, "plane 3: raw data of 1 bytes, expected 4", record="")


def test_every_kind_of_refusal_says_why_by_its_reason_code():
    """Code that meets a bad row (ingest, replay, a reader of someone's store) tells a blob cut
    short from a corrupt one, a newer format, a missing reference or a bad argument by
    ``reason``, never by parsing the message; the message still names the record."""
    ref = np.linspace(-3, 3, 64, dtype=np.float32)
    delta = encode_row(ref + np.float32(0.5), ref=ref)
    cases = {
        "truncated": lambda: decode_row(good_blob()[:20], record=REC),
        "magic": lambda: decode_row(sealed(b"XXXX" + body(ROW_PLANES, crc_row=ROW_CRC)[4:]), record=REC),
        "checksum": lambda: decode_row(good_blob()[:-1] + bytes([good_blob()[-1] ^ 1]), record=REC),
        "version": lambda: decode_row(good_blob(version=2), record=REC),
        "malformed": lambda: decode_row(good_blob(dtype=9), record=REC),
        "reference": lambda: decode_row(delta, record=REC),
        "input": lambda: encode_row("not a row", record=REC),  # type: ignore[arg-type]
    }
    assert set(cases) == set(REASONS)
    for reason, call in cases.items():
        with pytest.raises(CodecError) as e:
            call()
        assert (e.value.reason, str(e.value).startswith(f"logits record {REC!r}: ")) == (reason, True)
        back = pickle.loads(pickle.dumps(e.value))  # as an analysis worker raises it to the proxy
        assert (type(back), str(back), back.reason) == (CodecError, str(e.value), reason)
    with pytest.raises(CodecError) as e:  # the decoded row is not the row the blob was made of
        decode_row(blob(ROW_PLANES, crc_row=ROW_CRC ^ 1), record=REC)
    assert e.value.reason == "checksum"
