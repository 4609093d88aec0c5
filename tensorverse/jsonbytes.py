"""JSON to bytes with orjson, and the standard library where orjson cannot go.

orjson reads 1,024 levels of nesting but writes only 254: a request nested deeper, which the
proxy accepts and relays, would make every place that re-serialises it fail. Those rare values
are written by the standard library instead (orjson reads them back), with room on the
interpreter's stack for every level (the limit of 1,000 frames is reached near 1,000 levels less
the frames already in use: the fuzz suite found requests 900-1,024 deep that still failed).

`RawJSON` marks JSON text that is written as it is, never parsed and re-encoded: the recorder
stores parts of the upstream's answer this way (`tensorverse.store.turns`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import orjson

_LEVELS = 1100  # more than orjson reads: any value it decoded fits


class RawJSON:
    """JSON text of one value (as an upstream wrote it), which `dumps` embeds as it is."""

    __slots__ = ("text",)

    def __init__(self, text: bytes) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"RawJSON({self.text[:60]!r}{'...' if len(self.text) > 60 else ''})"

    def __eq__(self, other: object) -> bool:
        return type(other) is RawJSON and other.text == self.text

    __hash__ = None  # type: ignore[assignment]

    def loads(self) -> Any:
        return orjson.loads(self.text)


def _embed(value: Any) -> Any:
    if value.__class__ is RawJSON:
        return orjson.Fragment(value.text)
    if isinstance(value, msgspec.Struct):  # a typed record inside another (a compaction's runs)
        return msgspec.structs.asdict(value)
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def _embed_parsed(value: Any) -> Any:  # the standard library's fallback has no fragments
    if value.__class__ is RawJSON:
        return value.loads()
    return value.tolist() if hasattr(value, "tolist") else str(value)


def dumps(value: Any, option: int = 0) -> bytes:
    try:
        return orjson.dumps(value, default=_embed, option=option)
    except TypeError as e:
        if "Recursion limit" not in str(e):
            raise
        # The encoder recurses per level. The limit is raised for good, never set back: the
        # store's writer thread and the event loop both come here, and one thread setting it back
        # would cut the other's encoding short.
        if sys.getrecursionlimit() < _LEVELS * 2 + 500:
            sys.setrecursionlimit(_LEVELS * 2 + 500)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                          sort_keys=bool(option & orjson.OPT_SORT_KEYS),
                          default=_embed_parsed).encode()
