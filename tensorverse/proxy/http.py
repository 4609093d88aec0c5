"""The proxy's client-facing HTTP/1.1 server: an asyncio protocol over httptools' llhttp parser.

The core needs little of a server: each request (method, target, headers, the body as it
arrives), a response written as it goes (status and headers once, then bytes), flow control in
both directions, and its handler cancelled when the client goes away. aiohttp's server does that
and much more per request (an application, a router, request and response classes with lazily
parsed URLs, cookies and access logs); on the relay's thread that cost came before every first
token. This server does only what the core uses, under aiohttp's names (`Request.content.iter_any`,
`StreamResponse.prepare`/`write`/`write_eof`/`force_close`, `Response`), so the core reads like an
aiohttp handler. The admin listener stays on aiohttp. uvicorn serving the same core as an ASGI
application costs about a fifth more CPU per request (docs/proxy.md, "Why a hand-written server").

As a server it
* keeps connections alive (HTTP/1.1) and answers pipelined requests in order; HTTP/1.0 clients
  get their answer and the connection closes unless they asked for keep-alive and the length is
  known; idle connections close after ``keepalive_s``;
* hands the request body to the handler as it arrives (Content-Length or chunked), pausing the
  socket while more than `BODY_HIGH_WATER` bytes are unread; answers ``Expect: 100-continue``
  when the handler starts reading;
* refuses a request line over `MAX_LINE` bytes (414), a header field over `MAX_FIELD` bytes or
  more than `MAX_HEADERS` fields (431), anything llhttp cannot parse (400), a version but HTTP/1.1
  and 1.0 (505: llhttp reads HTTP/0.9 and 2.0 heads), a target that is not a path (authority
  form, ``*``: 400), ``CONNECT`` (405), any transfer coding but exactly ``chunked`` and a request
  with a body that asks for a protocol upgrade (501), then closes; an absolute-form target
  (``GET http://host/path``) is reduced to its path and query, so nothing but the path ever
  reaches the upstream;
* gives a request head `HEAD_TIMEOUT_S` from its first byte to arrive whole and a request body
  at most `BODY_TIMEOUT_S` of silence (408, then closes; a slow client cannot hold a connection
  one byte at a time);
* holds at most ``max_connections`` client connections: past it, the connection idle the
  longest (no request in flight) is closed to make room, and when every one is busy the new
  connection's request gets 503 with ``x-should-retry: true``;
* writes responses with Content-Length, chunked, or (HTTP/1.0) until the connection closes;
  HEAD, 1xx, 204 and 304 answers carry no body;
* makes ``write`` wait while the socket's buffer is over its high-water mark, so a slow client
  slows the relay instead of growing memory;
* cancels the handler's task when the connection is lost (the core then sees `CancelledError`;
  a write to a closed connection raises `ConnectionResetError`, as aiohttp's does);
* answers 500 for a handler that raises before its response began, and aborts the connection if
  it raises after.
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
import time
from collections import deque
from email.utils import formatdate
from typing import Awaitable, Callable, Iterable
from urllib.parse import unquote

import httptools
import orjson
from multidict import CIMultiDict, CIMultiDictProxy

log = logging.getLogger("tensorverse.proxy")

MAX_LINE = 8190  # the request target (aiohttp's limit)
MAX_FIELD = 8190  # one header field, name and value
MAX_HEADERS = 128  # header fields per request
MAX_HEAD = 64 << 10  # a request line and headers still unfinished after this many bytes: 431
BODY_HIGH_WATER = 1 << 20  # unread request body bytes before the socket is paused
MAX_PIPELINED = 16  # requests read ahead of the one being answered
KEEPALIVE_S = 75.0  # aiohttp's default
HEAD_TIMEOUT_S = 30.0  # from a request's first byte to the end of its headers
BODY_TIMEOUT_S = 60.0  # longest silence while a request body is awaited (nginx's client_body_timeout)
MAX_CONNECTIONS = 10_000  # client connections held at once

_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
_NO_BODY_STATUS = frozenset({204, 304})
_SET_BY_SERVER = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


class _Refused(Exception):
    """A request the server answers itself (status, message) and then closes the connection."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def origin_form(target: bytes) -> str:
    """A request target as the upstream gets it: a path and query (RFC 9112 §3.2). Origin form
    passes as it is; absolute form (``http://host/path?q``, any scheme) is reduced to its path and
    query, its scheme and host dropped; authority form (``host:port``) and asterisk form (``*``)
    are refused (400): nothing this proxy relays is addressed that way."""
    if target.startswith(b"/"):
        return target.decode("utf-8", "surrogateescape")
    try:
        url = httptools.parse_url(target)
    except httptools.HttpParserInvalidURLError:
        url = None
    if url is None or not url.schema or not url.host or (url.path and not url.path.startswith(b"/")):
        raise _Refused(400, "the request target must be a path (origin form) or an absolute URL")
    path = url.path or b"/"
    if url.query:
        path += b"?" + url.query
    return path.decode("utf-8", "surrogateescape")


class BodyReader:
    """A request body as it arrives; ``iter_any()`` yields what is buffered (aiohttp's name)."""

    __slots__ = ("_conn", "_chunks", "_size", "done", "_exc", "_waiter", "_continue")

    def __init__(self, conn: "_Connection", expect_continue: bool) -> None:
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self.done = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._continue = expect_continue

    def iter_any(self) -> "BodyReader":
        return self

    def __aiter__(self) -> "BodyReader":
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._chunks:
                return self.read_nowait()
            if self._exc is not None:
                raise self._exc
            if self.done:
                raise StopAsyncIteration
            if self._continue:
                self._continue = False
                self._conn._write_continue()
            self._waiter = w = self._conn.loop.create_future()
            try:
                await w
            finally:
                self._waiter = None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    def read_nowait(self) -> bytes:
        """What is buffered now (all of the body once `done`)."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        self._conn._consumed()
        return data

    # the connection's side
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self._wake()

    def _finish(self) -> None:
        self.done = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self.done and self._exc is None:
            self._exc = exc
            self._wake()

    def _discard(self) -> None:
        """Drop what is buffered (the request is answered)."""
        self._chunks.clear()
        self._size = 0

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class Request:
    """One request as the handler sees it (the attributes the core reads of aiohttp's).

    ``raw_path`` is the target in origin form (``/path?query``, still percent-encoded): an
    absolute-form target arrives here reduced to it, so no scheme or host a client wrote can
    reach the upstream."""

    __slots__ = ("method", "raw_path", "path", "query_string", "headers", "version", "keep_alive",
                 "content_length", "body_exists", "content", "_conn", "_refused")

    def __init__(self, conn: "_Connection", method: str, target: str, headers: CIMultiDictProxy[str],
                 version: str, keep_alive: bool) -> None:
        self._conn = conn
        self._refused: _Refused | None = None
        self.method = method
        self.raw_path = target
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        path, _, self.query_string = target.partition("?")
        self.path = unquote(path) if "%" in path else path
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        chunked = "Transfer-Encoding" in headers  # exactly "chunked": the server refused the rest
        self.body_exists = chunked or bool(self.content_length)
        expect = version == "1.1" and headers.get("Expect", "").lower() == "100-continue"
        self.content = BodyReader(conn, expect and self.body_exists)

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._conn.transport


class StreamResponse:
    """A response written as it goes: `prepare` sends the status line and headers."""

    def __init__(self, *, status: int = 200, reason: str | None = None,
                 headers: Iterable[tuple[str, str]] | CIMultiDict[str] | dict[str, str] | None = None) -> None:
        self.status = status
        self.reason = reason or _REASONS.get(status, "Unknown")
        self.headers: CIMultiDict[str] = CIMultiDict(headers or ())
        self.content_length: int | None = None
        self.prepared = False
        self._conn: _Connection | None = None
        self._chunked = False
        self._body = True  # the response may carry a body (not HEAD, 1xx, 204, 304)
        self._eof = False
        self._close = False

    def force_close(self) -> None:
        """Close the connection once this response is out (no keep-alive)."""
        self._close = True

    def _head(self, request: Request) -> bytes:
        status = self.status
        self._body = request.method != "HEAD" and status >= 200 and status not in _NO_BODY_STATUS
        keep = request.keep_alive and not self._close
        lines = [f"HTTP/1.1 {status} {self.reason}\r\n"]
        date = True
        for name, value in self.headers.items():
            low = name.lower()
            if low in _SET_BY_SERVER:
                continue
            if low == "date":
                date = False
            lines.append(f"{name}: {value}\r\n")
        if self.content_length is not None:
            lines.append(f"Content-Length: {self.content_length}\r\n")
        elif self._body and status >= 200 and status not in _NO_BODY_STATUS:
            if request.version == "1.1":
                self._chunked = True
                lines.append("Transfer-Encoding: chunked\r\n")
            else:
                keep = False  # an HTTP/1.0 body of unknown length ends with the connection
        if date:
            lines.append(f"Date: {_date()}\r\n")
        if not keep:
            self._close = True
            lines.append("Connection: close\r\n")
        elif request.version == "1.0":
            lines.append("Connection: keep-alive\r\n")
        lines.append("\r\n")
        head = "".join(lines)
        if head.count("\n") != len(lines) or head.count("\r") != len(lines):
            raise ValueError("a response header holds a line break")
        return head.encode("utf-8", "surrogateescape")

    async def prepare(self, request: Request) -> None:
        if self.prepared:
            return
        conn = request._conn
        if conn.gone():
            raise ConnectionResetError("Cannot write to closing transport")
        self._conn = conn
        first = self._first_bytes(self._head(request))
        self.prepared = True
        conn.responding = True
        conn.transport.write(first)  # type: ignore[union-attr]

    def _first_bytes(self, head: bytes) -> bytes:
        """What `prepare` sends: the head (a `Response` adds its body)."""
        return head

    async def write(self, data: bytes) -> None:
        conn = self._conn
        if conn is None or self._eof:
            raise RuntimeError("write() before prepare() or after write_eof()")
        if conn.closed:
            raise ConnectionResetError("Cannot write to closing transport")
        if not data or not self._body:
            return
        t = conn.transport
        if self._chunked:
            if len(data) < 65536:
                t.write(b"%x\r\n%b\r\n" % (len(data), data))  # type: ignore[union-attr]
            else:
                t.writelines((b"%x\r\n" % len(data), data, b"\r\n"))  # type: ignore[union-attr]
        else:
            t.write(data)  # type: ignore[union-attr]
        if conn.write_paused:
            await conn.drain()

    async def write_eof(self) -> None:
        if self._eof:
            return
        self._eof = True
        conn = self._conn
        if conn is not None and self._chunked and self._body and not conn.gone():
            conn.transport.write(b"0\r\n\r\n")  # type: ignore[union-attr]


class Response(StreamResponse):
    """A whole response (its body known up front), sent by the server after the handler returns."""

    def __init__(self, *, status: int = 200, reason: str | None = None, body: bytes = b"",
                 headers: Iterable[tuple[str, str]] | CIMultiDict[str] | dict[str, str] | None = None) -> None:
        super().__init__(status=status, reason=reason, headers=headers)
        self.body = body
        self.content_length = len(body)

    def _first_bytes(self, head: bytes) -> bytes:
        self._eof = True
        return head + self.body if self._body else head

    async def write_eof(self) -> None:
        self._eof = True


Handler = Callable[[Request], Awaitable[StreamResponse]]
ErrorBody = Callable[[int, str], bytes]

_date_cache: tuple[int, str] = (0, "")


def _date() -> str:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True))
    return _date_cache[1]


class _Connection(asyncio.Protocol):
    """One client connection: llhttp calls the ``on_*`` methods; `_serve` answers in order."""

    def __init__(self, server: "Server") -> None:
        self.server = server
        self.loop: asyncio.AbstractEventLoop = server.loop  # type: ignore[assignment]
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.write_paused = False
        self._drain: asyncio.Future | None = None
        self._queue: deque[Request] = deque()  # parsed requests not yet answered (the first is being)
        self._current: Request | None = None  # the request whose body is being parsed
        self._task: asyncio.Task | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._in_head = False  # between a request's first byte and the end of its headers
        self._head_bytes = 0  # bytes received while in the head (llhttp keeps partial fields)
        self._reading_paused = False
        self._stop_reading = False  # after an upgrade or a refused request: nothing more is parsed
        self.active = 0.0  # loop time of the last byte received or response finished (the idle sweep)
        self.head_started = 0.0  # loop time of the first byte of the head being received
        self.responding = False  # the answer to the first queued request has begun
        self.over_cap = False  # accepted past ``max_connections`` with none to evict: its request gets 503

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass
        server = self.server
        self.active = self.loop.time()
        if server.max_connections and len(server._connections) >= server.max_connections:
            self.over_cap = not server._evict_idle()
        server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._stop_reading:
            return
        self.active = self.loop.time()
        try:
            if self._head_bytes > MAX_HEAD:  # llhttp buffers a field until it ends: bound it
                raise _Refused(431, f"request headers longer than {MAX_HEAD} bytes")
            in_head = self._in_head
            self.parser.feed_data(data)
            if in_head and self._in_head:
                self._head_bytes += len(data)
        except httptools.HttpParserUpgrade:  # Upgrade/CONNECT: relayed as a plain request, then closed
            self._stop_reading = True
        except _Refused as e:
            self._refuse(e)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__ or e.__cause__
            self._refuse(cause if isinstance(cause, _Refused) else _Refused(400, f"bad request: {e}"))
        except httptools.HttpParserError as e:
            self._refuse(_Refused(400, f"bad request: {e or type(e).__name__}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server._connections.discard(self)
        gone = ConnectionResetError("the client closed the connection")
        for req in self._queue:
            req.content._fail(gone)
        w = self._drain
        if w is not None and not w.done():
            w.set_exception(gone)
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # the handler sees the client go away (aiohttp's handler_cancellation)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        w = self._drain
        if w is not None and not w.done():
            w.set_result(None)

    def gone(self) -> bool:
        """The connection is lost or closing (the core may have aborted it)."""
        return self.closed or self.transport is None or self.transport.is_closing()

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("Cannot write to closing transport")
        if not self.write_paused:
            return
        self._drain = w = self.loop.create_future()
        try:
            await w
        finally:
            self._drain = None

    # -- llhttp callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._in_head = True
        self._head_bytes = 0
        self.head_started = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE:
            raise _Refused(414, f"the request target is longer than {MAX_LINE} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > MAX_FIELD:
            raise _Refused(431, f"a header field is longer than {MAX_FIELD} bytes")
        self._headers.append((name, value))
        if len(self._headers) > MAX_HEADERS:
            raise _Refused(431, f"more than {MAX_HEADERS} header fields")

    def on_headers_complete(self) -> None:
        self._in_head = False
        p = self.parser
        method = p.get_method()
        version = p.get_http_version()
        if version not in ("1.1", "1.0"):  # llhttp also reads HTTP/0.9 (no version) and 2.0 heads
            raise _Refused(505, f"HTTP/{version} is not supported: HTTP/1.1 or 1.0 only")
        if method == b"CONNECT":
            raise _Refused(405, "CONNECT is not supported: this proxy relays API requests only")
        target = origin_form(self._url)
        h: CIMultiDict[str] = CIMultiDict()
        codings: list[bytes] = []
        for name, value in self._headers:
            if len(name) == 17 and name.lower() == b"transfer-encoding":
                codings += [c.strip().lower() for c in value.split(b",")]
            h.add(name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
        self._headers = []
        if codings and codings != [b"chunked"]:  # as h11: a coding the proxy cannot undo is never relayed
            raise _Refused(501, "unsupported Transfer-Encoding: only 'chunked' is accepted")
        if p.should_upgrade() and (codings or h.get("Content-Length", "0") not in ("0", "")):
            # httptools has llhttp skip the body of an upgrade request (it would belong to the new
            # protocol): relayed, it would reach the primary without its body
            raise _Refused(501, "a protocol upgrade (Upgrade + Connection: upgrade) on a request with a body "
                                "is not supported: send the request without asking to upgrade")
        if self.over_cap:
            raise _Refused(503, f"the proxy holds its limit of {self.server.max_connections} connections",
                           {"x-should-retry": "true", "Retry-After": "1"})
        req = Request(self, method.decode("ascii", "replace"), target,
                      CIMultiDictProxy(h), version, p.should_keep_alive())
        self._current = req
        self._queue.append(req)
        if self._task is None:
            self._task = self.loop.create_task(self._serve())
        self._update_reading()

    def on_body(self, body: bytes) -> None:
        req = self._current
        if req is not None:
            req.content._feed(body)
            self._update_reading()

    def on_message_complete(self) -> None:
        req = self._current
        if req is not None:
            req.content._finish()
            self._current = None

    # -- reading, writing ------------------------------------------------------------------------
    def _buffered(self) -> int:
        """Request body bytes received and not yet read (all queued requests)."""
        return sum(req.content._size for req in self._queue)

    def _consumed(self) -> None:
        if self._reading_paused:
            self._update_reading()

    def _update_reading(self) -> None:
        t = self.transport
        if t is None or self.closed:
            return
        pause = len(self._queue) > MAX_PIPELINED or self._buffered() > BODY_HIGH_WATER
        if pause != self._reading_paused:
            self._reading_paused = pause
            if pause:
                t.pause_reading()
            else:
                t.resume_reading()

    def _write_continue(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def close_if_idle(self, since: float) -> None:
        """Close the connection if nothing happened on it since loop time ``since``."""
        if self.idle() and self.active < since:
            self.transport.close()  # type: ignore[union-attr]

    def idle(self) -> bool:
        """No request is being answered or queued (a head may be arriving): may be closed."""
        return self._task is None and not self._queue and not self.gone()

    def check_deadlines(self, now: float) -> None:
        """The sweep's check of a slow client: a head not whole `head_timeout_s` after its first
        byte, or a body silent for `body_timeout_s` while it is awaited, gets 408 and the
        connection closes. Nothing is timed while the server itself holds reading back."""
        if self._stop_reading or self._reading_paused or self.gone():
            return
        server = self.server
        if self._in_head:
            if server.head_timeout_s and now - self.head_started > server.head_timeout_s:
                self._refuse(_Refused(408, f"the request head did not arrive within {server.head_timeout_s:g} s"))
        elif self._current is not None:
            if server.body_timeout_s and now - self.active > server.body_timeout_s:
                self._refuse(_Refused(408, f"the request body stalled for {server.body_timeout_s:g} s"))

    def _refuse(self, e: _Refused) -> None:
        """Stop parsing; the refusal is answered after the requests before it."""
        self._stop_reading = True
        req = self._current
        self._current = None
        if req is not None and not req.content.done:  # a broken body: its handler fails reading it
            req.content._fail(ConnectionResetError(f"request body: {e}"))
            return
        marker = Request(self, "GET", "/", CIMultiDictProxy(CIMultiDict()), "1.1", False)
        marker._refused = e
        self._queue.append(marker)
        if self._task is None:
            self._task = self.loop.create_task(self._serve())

    # -- answering -------------------------------------------------------------------------------
    async def _serve(self) -> None:
        handler = self.server.handler
        try:
            while self._queue and not self.closed:
                req = self._queue[0]
                if req._refused is not None:
                    await self._answer_refused(req)
                    return
                resp = await self._run(handler, req)
                if resp is None or self.gone():
                    return
                self._queue.popleft()
                req.content._discard()
                keep = req.keep_alive and not resp._close and req.content.done
                if not keep or (self._stop_reading and not self._queue):
                    self.transport.close()  # type: ignore[union-attr]  # after what is buffered
                    return
                self._update_reading()
        except asyncio.CancelledError:
            pass
        finally:
            self._task = None
            self.active = self.loop.time()

    async def _run(self, handler: Handler, req: Request) -> StreamResponse | None:
        """Run the handler and finish its response; None when the connection was aborted."""
        self.responding = False
        try:
            resp = await handler(req)
            if not resp.prepared:
                await resp.prepare(req)
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            raise
        except ConnectionResetError:
            self._abort()
            return None
        except Exception:
            log.exception("%s %s: the handler failed", req.method, req.raw_path)
            if self.gone() or self.responding:  # a response began: cut it, never append a second
                self._abort()
                return None
            resp = Response(status=500, body=self.server.error_body(500, "internal error in the proxy"),
                            headers={"Content-Type": "application/json"})
            resp.force_close()
            try:
                await resp.prepare(req)
            except (ConnectionResetError, ValueError):
                pass
            if not resp.prepared:
                self._abort()
                return None
            return resp

    async def _answer_refused(self, req: Request) -> None:
        e = req._refused
        assert e is not None
        log.info("refused a request: %s", e)
        self.server.refused += 1
        resp = Response(status=e.status, body=self.server.error_body(e.status, str(e)),
                        headers={"Content-Type": "application/json", **e.headers})
        resp.force_close()
        try:
            await resp.prepare(req)
        except ConnectionResetError:
            return
        self.transport.close()  # type: ignore[union-attr]

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _plain_error(status: int, message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": _REASONS.get(status, "Error"), "code": status}})


class Server:
    """Serves ``handler`` on a TCP port: `start`, `stop_listening`, `close`."""

    def __init__(self, handler: Handler, *, keepalive_s: float = KEEPALIVE_S,
                 head_timeout_s: float = HEAD_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, error_body: ErrorBody = _plain_error) -> None:
        self.handler = handler
        self.keepalive_s = keepalive_s  # 0: idle connections stay open
        self.head_timeout_s = head_timeout_s  # 0: no deadline
        self.body_timeout_s = body_timeout_s  # 0: no deadline
        self.max_connections = max_connections  # 0: no limit
        self.error_body = error_body
        self.evicted = 0  # idle connections closed to make room past ``max_connections``
        self.refused = 0  # requests the server answered itself (malformed, too slow, over the cap)
        self.loop: asyncio.AbstractEventLoop | None = None  # set by `start`
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int, *, backlog: int = 1024) -> int:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Connection(self), host, port, backlog=backlog)
        if self.keepalive_s or self.head_timeout_s or self.body_timeout_s:
            self._sweeper = self.loop.create_task(self._sweep())
        sockets = self._server.sockets or ()
        return sockets[0].getsockname()[1] if sockets else port

    def stop_listening(self) -> None:
        """New connections are refused; the open ones go on."""
        if self._server is not None:
            self._server.close()

    async def _sweep(self) -> None:
        """Close connections idle for ``keepalive_s`` and refuse slow clients (one pass now and
        then, not a timer per request: re-arming a timer after each answer cost more than the
        whole check). A deadline is met within a quarter of it (at most 5 s) late."""
        assert self.loop is not None
        limits = [t for t in (self.keepalive_s, self.head_timeout_s, self.body_timeout_s) if t]
        period = min(max(min(limits) / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(period)
            now = self.loop.time()
            since = now - self.keepalive_s if self.keepalive_s else float("-inf")
            for c in list(self._connections):
                c.check_deadlines(now)
                c.close_if_idle(since)

    def _evict_idle(self) -> bool:
        """Make room for one connection past ``max_connections``: close the one idle the longest
        (connections refused for the cap first); False when every connection is busy."""
        victim: _Connection | None = None
        for c in self._connections:
            if c.over_cap and not c.gone():
                victim = c
                break
            if c.idle() and (victim is None or c.active < victim.active):
                victim = c
        if victim is None:
            return False
        self.evicted += 1
        victim._abort()
        self._connections.discard(victim)
        return True

    def busy(self) -> int:
        """Connections with a request in flight."""
        return sum(1 for c in self._connections if c._queue)

    async def close(self, timeout: float) -> None:
        """Stop listening, close idle connections, give the busy ones ``timeout`` seconds to
        finish their requests, then cut them."""
        if self.loop is None:
            return
        self.stop_listening()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        deadline = self.loop.time() + max(timeout, 0.0)
        while True:
            for c in list(self._connections):
                c.close_if_idle(float("inf"))
            if not self.busy() or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        tasks = [c._task for c in self._connections if c._task is not None]
        for c in list(self._connections):
            c._abort()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        self._connections.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

