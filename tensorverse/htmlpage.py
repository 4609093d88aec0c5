"""What every HTML page Tensorverse writes needs: escaped text, JSON data that can sit inside a
``<script type="application/json">`` element, and the hash of an inline asset for a
Content-Security-Policy. The pages themselves (the viewer's export, the replay and matrix
reports, the hypercube site) are small fixed templates in their own modules.

Why no template engine: each page is a few lines of markup around one data element, whose
escaping rules live here and are tested here; Jinja2 would add a dependency to say the same.
"""

from __future__ import annotations

import base64
import hashlib
import html
from typing import Any

import orjson

__all__ = ["esc", "embed_json", "csp_hash"]

# what could end the data element (</script>), open a comment (<!--) or break a JavaScript
# string (U+2028/9); JSON.parse reads the escapes back as the original characters
_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def esc(v: Any) -> str:
    """``v`` as HTML text or attribute value (None as ``-``)."""
    return html.escape("-" if v is None else str(v), quote=True)


def embed_json(obj: Any) -> str:
    """JSON text that can sit inside a ``<script type="application/json">`` element (numpy values
    and non-string keys as orjson writes them)."""
    text = orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode()
    return text.translate(_ESCAPES)


def csp_hash(text: str) -> str:
    """The CSP source (``'sha256-...'``) that allows exactly this inline script or style."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"
