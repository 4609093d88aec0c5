"""The viewer's web app: static assets plus a small read-only JSON API over the store.

Routes (GET/HEAD only; any other method is answered 405 on every path)::

    /                      the app (static/index.html)
    /static/{app.js,app.css}
    /api/health            store path and format
    /api/backends          backend records (name, role, model, capture, settings)
    /api/sessions          ?q= &sort=time|turns|flips|verdict|backends &order=asc|desc
                           &offset= &limit= (<= 200) &verdict= &backend=
    /api/sessions/{id}     the session, its turns and the timeline
    /api/turns/{id}        the turn view (forced and free modes)
    /api/turns/{id}/panel  ?mode=forced&p=POS, or ?mode=free&n=NODE&p=POS: one position's top-k
                           panel (long turns: the view says ``lazy_panels``)

Every response carries a strict Content-Security-Policy (no inline script or style, no other
origin), ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer`` and
``X-Frame-Options: DENY``. Requests whose ``Host`` is not the address the server was bound to
(or a loopback name, when bound to loopback) are refused: a page on another site cannot read
the store through DNS rebinding. Store reads and view building run on worker threads; a turn
being built is built once however many requests ask for it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable

import orjson
from aiohttp import web

from tensorverse.viz.data import NotFound, ViewData

__all__ = ["create_app", "run", "CSP", "STATIC_DIR", "DEFAULT_HOST", "DEFAULT_PORT"]

log = logging.getLogger("tensorverse.viz")

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {"app.js": "text/javascript", "app.css": "text/css"}
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
ALLOWED_METHODS = ("GET", "HEAD")

_VIEW = web.AppKey("view", ViewData)
_POOL = web.AppKey("pool", ThreadPoolExecutor)
_INFLIGHT = web.AppKey("inflight", dict)
_HOSTS: web.AppKey[set[str] | None] = web.AppKey("hosts")
_STORE_PATH = web.AppKey("store_path", str)

_JSON_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _json(obj: Any, status: int = 200) -> web.Response:
    resp = web.Response(body=orjson.dumps(obj, option=_JSON_OPTS), status=status,
                        content_type="application/json")
    resp.headers["Cache-Control"] = "no-store"
    return resp


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message, "status": status}, status=status)


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _allowed_hosts(bind_host: str | None) -> set[str] | None:
    """Host names a request may carry; None = any (bound to every interface)."""
    if bind_host in (None, "", "0.0.0.0", "::"):
        return None
    hosts = {bind_host.lower().strip("[]")}
    if _loopback(bind_host):
        hosts |= {"localhost", "127.0.0.1", "::1"}
    return hosts


def _host_of(header: str) -> str:
    h = header.strip().lower()
    if h.startswith("["):  # [::1]:8765
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


@web.middleware
async def _guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    if request.method not in ALLOWED_METHODS:
        resp: web.StreamResponse = _error(405, "the viewer is read-only")
        resp.headers["Allow"] = ", ".join(ALLOWED_METHODS)
    else:
        hosts = request.app[_HOSTS]
        if hosts is not None and _host_of(request.headers.get("Host", "")) not in hosts:
            resp = _error(421, "unexpected Host header")
        else:
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                if exc.status >= 400:
                    resp = _error(exc.status, exc.reason)
                    if exc.status == 405:
                        resp.headers["Allow"] = ", ".join(ALLOWED_METHODS)
                else:
                    raise
    for k, v in SECURITY_HEADERS.items():
        resp.headers[k] = v
    return resp


async def _in_thread(request: web.Request, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[_POOL], lambda: fn(*args, **kwargs))


async def _api(request: web.Request, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> web.Response:
    try:
        result = await _in_thread(request, fn, *args, **kwargs)
    except NotFound as exc:
        return _error(404, str(exc.args[0]) if exc.args else "not found")
    except ValueError as exc:
        return _error(400, str(exc))
    except Exception:  # never leak a traceback (or store contents) to the browser
        log.exception("viewer: %s failed", request.path)
        return _error(500, "internal error (see the viewer's log)")
    resp = _json(result)
    resp.enable_compression()
    return resp


async def index(request: web.Request) -> web.Response:
    resp = web.FileResponse(STATIC_DIR / "index.html")
    resp.headers["Cache-Control"] = "no-cache"
    resp.content_type = "text/html"
    return resp  # type: ignore[return-value]


async def static(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name not in STATIC_FILES:
        raise web.HTTPNotFound()
    resp = web.FileResponse(STATIC_DIR / name)
    resp.content_type = STATIC_FILES[name]
    resp.headers["Cache-Control"] = "no-cache"
    return resp


async def health(request: web.Request) -> web.Response:
    view = request.app[_VIEW]
    fmt = await _in_thread(request, lambda: view.store.format_version)
    return _json({"ok": True, "store": request.app[_STORE_PATH], "format_version": fmt,
                  "read_only": True})


async def backends(request: web.Request) -> web.Response:
    return await _api(request, request.app[_VIEW].backends)


def _int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise web.HTTPBadRequest(reason=f"{name} must be an integer") from None


async def sessions(request: web.Request) -> web.Response:
    q = request.query
    return await _api(
        request, request.app[_VIEW].list_sessions,
        q=q.get("q", "")[:200], sort=q.get("sort", "time"), order=q.get("order", "desc"),
        offset=_int(request, "offset", 0), limit=_int(request, "limit", 50),
        verdict=q.get("verdict", ""), backend=q.get("backend", ""),
    )


async def verdict(request: web.Request) -> web.Response:
    return await _api(request, request.app[_VIEW].verdict)


async def session(request: web.Request) -> web.Response:
    return await _api(request, request.app[_VIEW].session_view, request.match_info["id"])


async def turn(request: web.Request) -> web.Response:
    """The turn view; concurrent requests for one turn share one build."""
    tid = request.match_info["id"]
    inflight = request.app[_INFLIGHT]
    task = inflight.get(tid)
    if task is None:
        task = asyncio.ensure_future(_api(request, request.app[_VIEW].turn_view, tid))
        inflight[tid] = task
        task.add_done_callback(lambda _t: inflight.pop(tid, None))
    resp = await asyncio.shield(task)
    # each request gets its own response object with the same body
    out = web.Response(body=resp.body, status=resp.status, content_type="application/json")
    out.headers["Cache-Control"] = "no-store"
    out.enable_compression()
    return out


async def panel(request: web.Request) -> web.Response:
    node = request.query.get("n")
    return await _api(
        request, request.app[_VIEW].panel, request.match_info["id"], request.query.get("mode", ""),
        _int(request, "p", -1), None if node in (None, "") else _int(request, "n", 0),
    )


def create_app(store: Any, *, host: str | None = DEFAULT_HOST, workers: int = 2,
               inline_rows: int | None = None) -> web.Application:
    """The viewer app over an open store (or a store path, opened read-only). ``host``: the
    address it is served on (requests naming another Host are refused). ``inline_rows``: turns
    whose top-k panels need more rows than this get them lazily, per position."""
    if isinstance(store, (str, os.PathLike)):
        from tensorverse.store import Store

        store = Store.open(store, readonly=True)
    app = web.Application(middlewares=[_guard], client_max_size=1024)
    app[_VIEW] = ViewData(store) if inline_rows is None else ViewData(store, inline_rows=inline_rows)
    app[_POOL] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tv-view")
    app[_INFLIGHT] = {}
    app[_HOSTS] = _allowed_hosts(host)
    app[_STORE_PATH] = str(getattr(store, "path", ""))
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/api/health", health)
    app.router.add_get("/api/backends", backends)
    app.router.add_get("/api/sessions", sessions)
    app.router.add_get("/api/sessions/{id}", session)
    app.router.add_get("/api/verdict", verdict)
    app.router.add_get("/api/turns/{id}", turn)
    app.router.add_get("/api/turns/{id}/panel", panel)

    async def _close(app: web.Application) -> None:
        app[_POOL].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_close)
    return app


def run(store_path: str, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> int:
    """Serve the viewer until interrupted (``tensorverse view``)."""
    from tensorverse.store import Store

    store = Store.open(store_path, readonly=True)
    if not _loopback(host):
        log.warning("viewer listening on %s: prompts and model output are visible to anyone "
                    "who can reach this address", host)
    app = create_app(store, host=host)
    shown = f"[{host}]" if ":" in host else host
    print(f"tensorverse view: http://{shown}:{port}/  (store {store.path}, read-only; Ctrl-C stops)",
          flush=True)
    try:
        web.run_app(app, host=host, port=port, print=None, access_log=None)
    finally:
        store.close()
    return 0
