"""One session as one self-contained HTML file (``tensorverse export html``).

The file holds the viewer's CSS and JS inline and the session's data (the session view and every
turn view) as JSON in ``<script type="application/json" id="tv-data">``; it opens from disk with
no network. Its Content-Security-Policy (a ``<meta>``) allows exactly the inline script and
style whose SHA-256 hashes it lists and nothing else: no other script, no connection, no image
from anywhere but ``data:``.

The JSON is made safe to embed by escaping ``<``, ``>`` and ``&`` (``\\u003c`` ...), so no
model output can close the data element (``</script>``) or open a comment; ``JSON.parse``
reads the escapes back as the original characters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


from tensorverse.htmlpage import csp_hash, embed_json, esc
from tensorverse.viz.data import ViewData
from tensorverse.viz.server import STATIC_DIR

__all__ = ["render_html", "export_session"]

def _inline_safe(code: str, tag: str) -> str:
    # An inline <script>/<style> ends at the first "</tag", and "<!--" / "<script" inside a
    # script change how the HTML parser reads it: our own assets never contain them.
    low = code.lower()
    for bad in (f"</{tag}", "<!--", "<script"):
        if bad in low:
            raise ValueError(f"asset contains {bad!r} and cannot be inlined")
    return code


def render_html(bundle: dict, *, title: str | None = None) -> str:
    """The export page for a bundle from :meth:`ViewData.export_bundle`."""
    js = _inline_safe((STATIC_DIR / "app.js").read_text(encoding="utf-8"), "script")
    css = _inline_safe((STATIC_DIR / "app.css").read_text(encoding="utf-8"), "style")
    csp = (f"default-src 'none'; script-src {csp_hash(js)}; style-src {csp_hash(css)}; "
           "img-src data:; base-uri 'none'; form-action 'none'")
    sid = str(bundle.get("session", {}).get("session", {}).get("id", ""))
    page_title = esc(title or f"Tensorverse · session {sid}")
    return (
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{esc(csp)}\">\n"
        "<meta name=\"referrer\" content=\"no-referrer\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{page_title}</title>\n<style>{css}</style>\n</head>\n<body>\n"
        "<header class=\"top\"><a class=\"brand\" href=\"#/\">Tensorverse</a>"
        "<nav id=\"crumbs\" aria-label=\"breadcrumb\"></nav><span class=\"spacer\"></span>"
        "<span id=\"status\" class=\"muted\" role=\"status\"></span></header>\n"
        "<main id=\"app\"><p class=\"muted\">Loading…</p></main>\n"
        f"<script type=\"application/json\" id=\"tv-data\">{embed_json(bundle)}</script>\n"
        f"<script>{js}</script>\n</body>\n</html>\n"
    )


def export_session(store: Any, session_id: str, out: str | os.PathLike) -> Path:
    """Write the HTML export of one session; returns the path written."""
    bundle = ViewData(store).export_bundle(session_id)
    page = render_html(bundle)
    path = Path(out)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)
    return path
