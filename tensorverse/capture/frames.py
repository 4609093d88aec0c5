"""Binary frames that carry captured logits rows from a vLLM server to the recorder.

One frame is one row: which capture (run) it belongs to, which output position, and the codec
blob (:mod:`tensorverse.store.codec`). An HTTP body is a plain concatenation of frames.

Frame layout (version 1, little-endian)::

    offset  size  field
    0       4     magic b"TVFR"
    4       1     frame format version (1)
    5       1     flags: bit 0 (FLAG_ENGINE_STATE) = an engine state follows the capture id;
                  bit 1 (FLAG_COMPACT) = the blob is the row's compact form
                  (:mod:`tensorverse.store.compact`), not a codec blob;
                  other bits reserved, must be 0
    6       2     capture id length L (uint16, 1..MAX_ID_BYTES)
    8       8     origin (uint64): random id of the capturing process (one per tap)
    16      8     seq (uint64): per-origin sequence number, increasing from 1
    24      4     position (uint32): output position (0 = first generated token)
    28      4     blob length B (uint32, 0..MAX_BLOB_BYTES)
    32      L     capture id, UTF-8
    32+L    E     engine state (E = 32 with FLAG_ENGINE_STATE, else 0;
                  :class:`tensorverse.store.engine_state.EngineState`)
    32+L+E  B     codec blob
    +B      4     crc32 of every byte of the frame before it

A frame without flags is byte-for-byte what this format was before engine states and compact
rows (a plugin with engine state switched off and no ``tv_compact`` sends those).

Deduplication: ``(origin, seq)`` names one frame exactly; a receiver that sees it twice (an HTTP
batch retried after a lost response) keeps the first. ``(capture_id, position)`` names a row;
rows are written idempotently under that key.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from tensorverse.refusal import Refusal
from tensorverse.store.engine_state import ENGINE_STATE_SIZE, EngineState, EngineStateError

__all__ = ["Frame", "FrameError", "REASONS", "encode_frame", "iter_frames", "parse_frames",
           "MAGIC", "FRAME_VERSION", "HEADER_SIZE", "MAX_ID_BYTES", "MAX_BLOB_BYTES",
           "CONTENT_TYPE", "FLAG_ENGINE_STATE", "FLAG_COMPACT"]

MAGIC = b"TVFR"
FRAME_VERSION = 1
CONTENT_TYPE = "application/vnd.tensorverse.frames"
MAX_ID_BYTES = 1024
MAX_BLOB_BYTES = 256 << 20  # far above any row (a 256k-entry float32 row is 1 MiB)
FLAG_ENGINE_STATE = 0x01
FLAG_COMPACT = 0x02
_FLAGS = FLAG_ENGINE_STATE | FLAG_COMPACT

_HEAD = struct.Struct("<4sBBHQQII")
HEADER_SIZE = _HEAD.size  # 32
_CRC = struct.Struct("<I")
_U64 = 1 << 64
_U32 = 1 << 32


#: why a body of frames is refused (`FrameError.reason`): ``truncated``, ``magic`` (not a frame,
#: or the stream lost sync), ``version``, ``flags`` (unknown), ``capture_id`` (its length, UTF-8,
#: or an id the store refuses), ``blob_size`` (over `MAX_BLOB_BYTES`), ``crc`` (garbled in
#: transit), ``engine_state`` (an unknown layout), ``compact`` (a compact row that does not check)
REASONS = ("truncated", "magic", "version", "flags", "capture_id", "blob_size", "crc", "engine_state", "compact")


class FrameError(Refusal):
    """A frame buffer is truncated, garbled, or from an unknown format version; ``reason`` (one
    of `REASONS`) says which, for code (ingest answers it beside the message)."""

    REASONS = REASONS


@dataclass(frozen=True, slots=True)
class Frame:
    capture_id: str
    position: int
    seq: int
    origin: int
    blob: bytes
    engine: EngineState | None = None
    compact: bool = False  # the blob is a compact row (FLAG_COMPACT)

    @property
    def size(self) -> int:
        return (HEADER_SIZE + len(self.capture_id.encode("utf-8")) + len(self.blob) + _CRC.size
                + (ENGINE_STATE_SIZE if self.engine is not None else 0))


def encode_frame(capture_id: str, position: int, blob: bytes, *, seq: int, origin: int = 0,
                 engine: EngineState | None = None, compact: bool = False) -> bytes:
    """One frame as bytes (see the module docstring for the layout)."""
    if not isinstance(capture_id, str) or not capture_id:
        raise ValueError(f"capture id must be a non-empty string, got {capture_id!r}")
    cid = capture_id.encode("utf-8")
    if len(cid) > MAX_ID_BYTES:
        raise ValueError(f"capture id is {len(cid)} bytes in UTF-8, at most {MAX_ID_BYTES}")
    if not 0 <= position < _U32:
        raise ValueError(f"position {position} out of range 0..2**32-1")
    if not 0 <= seq < _U64 or not 0 <= origin < _U64:
        raise ValueError("seq and origin must fit in 64 bits")
    blob = bytes(blob)
    if len(blob) > MAX_BLOB_BYTES:
        raise ValueError(f"blob of {len(blob)} bytes exceeds {MAX_BLOB_BYTES}")
    flags, state = (FLAG_ENGINE_STATE, engine.pack()) if engine is not None else (0, b"")
    flags |= FLAG_COMPACT if compact else 0
    body = b"".join((_HEAD.pack(MAGIC, FRAME_VERSION, flags, len(cid), origin, seq, position, len(blob)),
                     cid, state, blob))
    return body + _CRC.pack(zlib.crc32(body))


class _Where(NamedTuple):
    """Where a frame starts, for :class:`FrameError`'s message (``frame 3 at byte 120 of 900``)."""

    frame: int
    off: int
    n: int

    def __str__(self) -> str:
        return f"frame {self.frame} at byte {self.off} of {self.n}"


def iter_frames(buf: bytes | bytearray | memoryview) -> Iterator[Frame]:
    """Yield the frames of ``buf`` in order.

    Raises :class:`FrameError` (naming the frame's index and byte offset) at the first frame
    that is truncated, has a wrong magic, version, flags or length, a capture id that is not
    UTF-8, or a crc mismatch. Frames before it have already been yielded: use
    :func:`parse_frames` to accept a body all or nothing.
    """
    view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
    n = len(view)
    off = 0
    index = 0
    while off < n:
        where = _Where(index, off, n)  # formatted only into an error
        if n - off < HEADER_SIZE:
            raise FrameError(f"{where}: truncated header ({n - off} of {HEADER_SIZE} bytes)", "truncated")
        magic, version, flags, id_len, origin, seq, position, blob_len = _HEAD.unpack_from(view, off)
        if magic != MAGIC:
            raise FrameError(f"{where}: bad magic {bytes(magic)!r} (expected {MAGIC!r}): "
                             "not a Tensorverse frame, or the stream lost sync", "magic")
        if version != FRAME_VERSION:
            raise FrameError(f"{where}: unsupported frame version {version} "
                             f"(this reader knows {FRAME_VERSION})", "version")
        if flags & ~_FLAGS:
            raise FrameError(f"{where}: unknown flags 0x{flags:02x}", "flags")
        es = ENGINE_STATE_SIZE if flags & FLAG_ENGINE_STATE else 0
        if not 1 <= id_len <= MAX_ID_BYTES:
            raise FrameError(f"{where}: capture id length {id_len} outside 1..{MAX_ID_BYTES}", "capture_id")
        if blob_len > MAX_BLOB_BYTES:
            raise FrameError(f"{where}: blob length {blob_len} exceeds {MAX_BLOB_BYTES}", "blob_size")
        total = HEADER_SIZE + id_len + es + blob_len + _CRC.size
        if n - off < total:
            raise FrameError(f"{where}: truncated ({n - off} of {total} bytes; capture id "
                             f"{id_len} bytes, engine state {es} bytes, blob {blob_len} bytes)", "truncated")
        end = off + total - _CRC.size
        (crc,) = _CRC.unpack_from(view, end)
        if zlib.crc32(view[off:end]) != crc:
            raise FrameError(f"{where}: crc32 mismatch (frame garbled in transit)", "crc")
        id_start = off + HEADER_SIZE
        try:
            capture_id = str(view[id_start:id_start + id_len], "utf-8")
        except UnicodeDecodeError as e:
            raise FrameError(f"{where}: capture id is not UTF-8 ({e})", "capture_id") from None
        engine = None
        if es:
            try:
                engine = EngineState.unpack(view[id_start + id_len:id_start + id_len + es])
            except EngineStateError as e:
                raise FrameError(f"{where}: {e}", "engine_state") from None
        blob = bytes(view[id_start + id_len + es:end])
        yield Frame(capture_id, position, seq, origin, blob, engine, bool(flags & FLAG_COMPACT))
        off += total
        index += 1


def parse_frames(buf: bytes | bytearray | memoryview) -> list[Frame]:
    """All frames of ``buf``, or :class:`FrameError` if any of them is bad (nothing partial)."""
    return list(iter_frames(buf))
