"""The proxy core as a raw ASGI application on uvicorn (httptools + uvloop): the other candidate
of the client-facing server decision (docs/proxy.md, "Why a hand-written server").

`proxy_overhead.py` runs it as one more target beside the hand-written server
(`tensorverse.proxy.http`) and nginx, in the same run. It is the same `ProxyCore` with the same
addons; only what serves clients differs. What ASGI needs and the hand-written server does not
is counted in: a request object built from the scope, one ``send`` of a message dict per event,
and a task that waits for ``http.disconnect`` so that a client that goes away cancels the
upstream request (uvicorn does not cancel the application on its own).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable
from urllib.parse import unquote

import uvicorn
from multidict import CIMultiDict, CIMultiDictProxy

_SET_BY_SERVER = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


class _Transport:
    """What the core asks of a request's transport: ``is_closing()`` and ``abort()``."""

    __slots__ = ("closing", "aborted")

    def __init__(self) -> None:
        self.closing = False  # the client went away
        self.aborted = False  # the core cut the response (the upstream failed mid-response)

    def is_closing(self) -> bool:
        return self.closing or self.aborted

    def abort(self) -> None:
        self.aborted = True


class _Body:
    """The request body from ``receive`` (``iter_any``, ``read_nowait``, ``done``)."""

    __slots__ = ("_receive", "done")

    def __init__(self, receive: Any, exists: bool) -> None:
        self._receive = receive
        self.done = not exists

    def iter_any(self) -> "_Body":
        return self

    def __aiter__(self) -> "_Body":
        return self

    async def __anext__(self) -> bytes:
        while not self.done:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                raise ConnectionResetError("the client closed the connection")
            self.done = not msg.get("more_body", False)
            if msg.get("body"):
                return msg["body"]
        raise StopAsyncIteration

    def read_nowait(self) -> bytes:
        return b""


class Request:
    """The attributes of `tensorverse.proxy.http.Request` the core reads, from an ASGI scope."""

    def __init__(self, scope: dict, receive: Any, send: Any) -> None:
        self.method = scope["method"]
        self.query_string = scope["query_string"].decode("latin-1")
        raw = scope.get("raw_path") or scope["path"].encode()
        self.raw_path = raw.decode("latin-1") + ("?" + self.query_string if self.query_string else "")
        self.path = scope["path"] if "%" not in raw.decode("latin-1") else unquote(raw.decode("latin-1"))
        h: CIMultiDict[str] = CIMultiDict()
        for name, value in scope["headers"]:
            h.add(name.decode("latin-1"), value.decode("latin-1"))
        self.headers = CIMultiDictProxy(h)
        self.version = scope["http_version"]
        self.keep_alive = True
        length = h.get("content-length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.body_exists = "transfer-encoding" in h or bool(self.content_length)
        self.content = _Body(receive, self.body_exists)
        self.transport = _Transport()
        self.receive = receive
        self.send = send
        self.watcher: asyncio.Task | None = None


class StreamResponse:
    """`tensorverse.proxy.http.StreamResponse`'s interface over ASGI ``send``."""

    def __init__(self, *, status: int = 200, reason: str | None = None,
                 headers: Iterable[tuple[str, str]] | CIMultiDict[str] | dict[str, str] | None = None) -> None:
        self.status = status
        self.reason = reason
        self.headers: CIMultiDict[str] = CIMultiDict(headers or ())
        self.content_length: int | None = None
        self.prepared = False
        self._request: Request | None = None
        self._eof = False

    def force_close(self) -> None:
        self.headers["Connection"] = "close"

    def _start(self) -> dict:
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()
                   if k.lower() not in _SET_BY_SERVER]
        if self.headers.get("Connection") == "close":
            headers.append((b"connection", b"close"))
        if self.content_length is not None:
            headers.append((b"content-length", b"%d" % self.content_length))
        return {"type": "http.response.start", "status": self.status, "headers": headers}

    async def prepare(self, request: Request) -> None:
        if self.prepared:
            return
        if request.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        self._request = request
        self.prepared = True
        _watch(request)
        await request.send(self._start())

    async def write(self, data: bytes) -> None:
        req = self._request
        if req is None or self._eof:
            raise RuntimeError("write() before prepare() or after write_eof()")
        if req.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if data:
            await req.send({"type": "http.response.body", "body": data, "more_body": True})

    async def write_eof(self) -> None:
        if self._eof or self._request is None:
            return
        self._eof = True
        if not self._request.transport.is_closing():
            await self._request.send({"type": "http.response.body", "body": b"", "more_body": False})


class Response(StreamResponse):
    def __init__(self, *, status: int = 200, reason: str | None = None, body: bytes = b"",
                 headers: Iterable[tuple[str, str]] | CIMultiDict[str] | dict[str, str] | None = None) -> None:
        super().__init__(status=status, reason=reason, headers=headers)
        self.body = body
        self.content_length = len(body)

    async def prepare(self, request: Request) -> None:
        if self.prepared:
            return
        await super().prepare(request)
        self._eof = True
        await request.send({"type": "http.response.body", "body": self.body, "more_body": False})

    async def write_eof(self) -> None:
        self._eof = True


def _watch(request: Request) -> None:
    """Once the body is read: a client that goes away cancels the handler (as the hand-written
    server does), so the upstream request is closed and vLLM aborts the generation."""
    if request.watcher is not None or not request.content.done:
        return
    task = asyncio.current_task()

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                request.transport.closing = True
                if task is not None:
                    task.cancel()
                return

    request.watcher = asyncio.get_running_loop().create_task(watch())


class AsgiApp:
    """``ProxyCore.handle`` as an ASGI application."""

    def __init__(self, core: Any) -> None:
        self.core = core
        core.responses = __import__(__name__, fromlist=["Response"])  # this module's classes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        req = Request(scope, receive, send)
        try:
            resp = await self.core.handle(req)
            if not resp.prepared:
                await resp.prepare(req)
            await resp.write_eof()
        except asyncio.CancelledError:
            if req.transport.closing:  # the client went away: the core has seen it
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                return
            raise
        except ConnectionResetError:
            return
        finally:
            if req.watcher is not None:
                req.watcher.cancel()
        if req.transport.aborted:
            raise ConnectionAbortedError("the upstream failed mid-response")  # uvicorn cuts the connection


async def serve(core: Any, host: str, port: int) -> uvicorn.Server:
    """Start ``core`` behind uvicorn on host:port (its startup, then uvicorn's)."""
    await core._on_startup()
    config = uvicorn.Config(AsgiApp(core), host=host, port=port, http="httptools", lifespan="off",
                            access_log=False, log_level="warning", timeout_keep_alive=75, backlog=1024)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup()
    asyncio.get_running_loop().create_task(server.main_loop())
    return server
