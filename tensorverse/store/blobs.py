"""How a record becomes the bytes the store keeps: JSON (orjson), turns in a zstd frame.

Used by the store's readers and writer (`tensorverse.store.store`) and by its migrations
(`tensorverse.store.schema`), which rewrite records in place; rows are codec blobs instead
(`tensorverse.store.codec`).
"""

from __future__ import annotations

import threading
from typing import Any

import orjson
import zstandard

from tensorverse.jsonbytes import dumps as _json_dumps
from tensorverse.store.codec import decompressor

__all__ = ["dumps", "compress", "loads", "ZSTD_MAGIC"]

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame; JSON text never starts with it
_local = threading.local()  # zstandard's objects are not thread-safe


def dumps(value: Any) -> bytes:
    return _json_dumps(value, orjson.OPT_SERIALIZE_NUMPY)  # deeper than orjson writes: the stdlib


def compress(blob: bytes) -> bytes:
    """A turn's JSON as stored (zstd's defaults: the codec's compressors are tuned for logits)."""
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=3)
    return c.compress(blob)


def loads(raw: bytes) -> Any:
    """A stored record: JSON, or JSON in a zstd frame (turns, from store format 2)."""
    if raw[:4] == ZSTD_MAGIC:
        raw = decompressor().decompress(raw)
    return orjson.loads(raw)
