import pickle
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorverse.capture.frames import (
    FLAG_ENGINE_STATE,
    HEADER_SIZE,
    MAGIC,
    Frame,
    REASONS,
    FrameError,
    encode_frame,
    iter_frames,
    parse_frames,
)
from tensorverse.store.engine_state import ENGINE_STATE_SIZE, RUNNER_V1, RUNNER_V2, EngineState, EngineStateError


def _frames():
    return [
        Frame("run-1", 0, 1, 7, b"\x00blob\xff"),
        Frame("run-1", 1, 2, 7, b""),
        Frame("ünïcode/ид", 4_000_000_000, 3, 2**64 - 1, bytes(range(256)) * 3),
        Frame("run-2", 3, 4, 7, b"rowrow", EngineState(RUNNER_V2, 2**40, 32, 31, 1, 9000, 3)),
    ]


def _body(frames):
    return b"".join(encode_frame(f.capture_id, f.position, f.blob, seq=f.seq, origin=f.origin,
                                 engine=f.engine) for f in frames)


def test_engine_state_layout_and_flag():
    st = EngineState(RUNNER_V1, 12, 3, 2, joined=1)
    raw = encode_frame("ab", 5, b"XYZ", seq=9, origin=3, engine=st)
    assert raw[5] == FLAG_ENGINE_STATE
    assert raw[HEADER_SIZE + 2:HEADER_SIZE + 2 + ENGINE_STATE_SIZE] == st.pack()
    assert struct.unpack_from("<BBBBiqiiii", raw, HEADER_SIZE + 2) == (2, 1, 0, 0, 3, 12, 2, 1, -1, -1)
    tp2 = EngineState(RUNNER_V1, 12, 3, 2, joined=1, tp=2, pp=1)
    assert tp2.pack()[:4] == bytes([2, 1, 2, 1]) and EngineState.unpack(tp2.pack()) == tp2
    # layout 1 (two reserved zero bytes where tp and pp are) reads with the layout unknown
    v1 = struct.pack("<BBHiqiiii", 1, 1, 0, 3, 12, 2, 1, -1, -1)
    assert EngineState.unpack(v1) == st and st.as_dict()["tp"] is None
    with pytest.raises(EngineStateError):
        EngineState(RUNNER_V1, 1, 1, 0, tp=256).pack()
    assert raw[HEADER_SIZE + 2 + ENGINE_STATE_SIZE:-4] == b"XYZ"
    (f,) = parse_frames(raw)
    assert f.engine == st and f.blob == b"XYZ" and f.size == len(raw)
    # a frame without a state is unchanged from the format before engine states
    assert encode_frame("ab", 5, b"XYZ", seq=9, origin=3)[5] == 0
    bad = bytearray(raw)
    bad[5] = 0x05  # an unknown flag bit next to the known ones
    bad[-4:] = struct.pack("<I", zlib.crc32(bytes(bad[:-4])))
    with pytest.raises(FrameError) as e:
        parse_frames(bytes(bad))
    assert e.value.reason == "flags"
    bad = bytearray(raw)
    bad[HEADER_SIZE + 2] = 9  # an engine-state layout this reader does not know
    bad[-4:] = struct.pack("<I", zlib.crc32(bytes(bad[:-4])))
    with pytest.raises(FrameError) as e:
        parse_frames(bytes(bad))
    assert e.value.reason == "engine_state"


def test_roundtrip_several_frames_per_body():
    frames = _frames()
    body = _body(frames)
    assert parse_frames(body) == frames
    assert list(iter_frames(bytearray(body))) == frames
    assert list(iter_frames(memoryview(body))) == frames
    assert sum(f.size for f in frames) == len(body)
    assert parse_frames(b"") == []


def test_layout_is_as_documented():
    raw = encode_frame("ab", 5, b"XYZ", seq=9, origin=3)
    assert raw[:4] == MAGIC and raw[4] == 1 and raw[5] == 0
    id_len, origin, seq, pos, blob_len = struct.unpack_from("<HQQII", raw, 6)
    assert (id_len, origin, seq, pos, blob_len) == (2, 3, 9, 5, 3)
    assert raw[HEADER_SIZE:HEADER_SIZE + 2] == b"ab"
    assert raw[HEADER_SIZE + 2:HEADER_SIZE + 5] == b"XYZ"
    assert struct.unpack("<I", raw[-4:])[0] == zlib.crc32(raw[:-4])


def test_every_truncation_is_reported():
    body = _body(_frames())
    ends = set()
    off = 0
    for f in _frames():
        off += f.size
        ends.add(off)
    for cut in range(len(body)):
        if cut in ends or cut == 0:
            continue
        with pytest.raises(FrameError) as e:
            parse_frames(body[:cut])
        assert e.value.reason == "truncated"


def test_iter_yields_good_frames_before_the_bad_one():
    frames = _frames()[:3]
    body = _body(frames)
    it = iter_frames(body[:-1])
    assert next(it) == frames[0]
    assert next(it) == frames[1]
    with pytest.raises(FrameError, match=r"frame 2 at byte \d+"):
        next(it)


def test_every_single_byte_corruption_is_caught():
    raw = encode_frame("run-x", 3, b"payload-bytes", seq=1, origin=2)
    reasons = set()
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x41
        with pytest.raises(FrameError) as e:
            parse_frames(bytes(bad))
        reasons.add(e.value.reason)
    # the header's own checks say what they saw; every other byte is the crc's
    assert reasons <= {"magic", "version", "flags", "capture_id", "blob_size", "truncated", "crc"}
    assert {"magic", "version", "crc"} <= reasons


def test_each_refusal_has_its_reason_code_and_a_message_naming_the_frame():
    raw = encode_frame("r", 0, b"x", seq=1)
    cases = [(b"XXXX" + raw[4:], "magic"), (raw[:4] + b"\x09" + raw[5:], "version"),
             (raw[:-5] + b"y" + raw[-4:], "crc"), (raw[:10], "truncated")]
    for body, reason in cases:
        with pytest.raises(FrameError) as e:
            parse_frames(body)
        assert e.value.reason == reason and str(e.value).startswith("frame 0 at byte 0")
        back = pickle.loads(pickle.dumps(e.value))
        assert (str(back), back.reason) == (str(e.value), reason)
    assert set(REASONS) >= {r for _, r in cases}


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError):
        encode_frame("", 0, b"", seq=1)
    with pytest.raises(ValueError):
        encode_frame("x" * 2000, 0, b"", seq=1)
    with pytest.raises(ValueError):
        encode_frame("r", -1, b"", seq=1)
    with pytest.raises(ValueError):
        encode_frame("r", 2**32, b"", seq=1)
    with pytest.raises(ValueError):
        encode_frame("r", 0, b"", seq=2**64)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1, max_size=40), st.integers(0, 2**32 - 1),
                          st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                          st.binary(max_size=300)), max_size=6))
def test_roundtrip_property(items):
    frames = [Frame(c, p, s, o, b) for c, p, s, o, b in items]
    assert parse_frames(_body(frames)) == frames


def test_compact_flag_roundtrips_and_unknown_flags_are_refused():
    from tensorverse.capture.frames import FLAG_COMPACT

    raw = encode_frame("r", 3, b"TVCR...", seq=1, compact=True)
    assert raw[5] == FLAG_COMPACT
    (f,) = parse_frames(raw)
    assert f.compact and f.blob == b"TVCR..."
    both = encode_frame("r", 3, b"x", seq=2, compact=True, engine=EngineState(RUNNER_V1, 1, 2, 0, 0, -1, -1))
    assert parse_frames(both)[0].compact and parse_frames(both)[0].engine is not None
    assert not parse_frames(encode_frame("r", 3, b"x", seq=3))[0].compact
    body = bytearray(raw[:-4])
    body[5] = 0x04
    with pytest.raises(FrameError) as e:
        parse_frames(bytes(body) + struct.pack("<I", zlib.crc32(bytes(body))))
    assert e.value.reason == "flags"
