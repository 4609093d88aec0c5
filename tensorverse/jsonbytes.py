"""JSON to bytes with orjson, and the standard library where orjson cannot go.

orjson reads 1,024 levels of nesting but writes only 254: a request nested deeper, which the
proxy accepts and relays, would make every place that re-serialises it fail. Those rare values
are written by the standard library instead (orjson reads them back).
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(value: Any, option: int = 0) -> bytes:
    try:
        return orjson.dumps(value, option=option)
    except TypeError as e:
        if "Recursion limit" not in str(e):
            raise
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                          sort_keys=bool(option & orjson.OPT_SORT_KEYS),
                          default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)).encode()
