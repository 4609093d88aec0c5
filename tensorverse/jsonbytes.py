"""JSON to bytes with orjson, and the standard library where orjson cannot go.

orjson reads 1,024 levels of nesting but writes only 254: a request nested deeper, which the
proxy accepts and relays, would make every place that re-serialises it fail. Those rare values
are written by the standard library instead (orjson reads them back), with room on the
interpreter's stack for every level (the limit of 1,000 frames is reached near 1,000 levels less
the frames already in use: the fuzz suite found requests 900-1,024 deep that still failed).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import orjson

_LEVELS = 1100  # more than orjson reads: any value it decoded fits


def dumps(value: Any, option: int = 0) -> bytes:
    try:
        return orjson.dumps(value, option=option)
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
                          default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)).encode()
