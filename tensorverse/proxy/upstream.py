"""A lean HTTP/1.1 client for the primary: the relay's upstream side for LLM endpoints.

aiohttp's ClientSession does much per request that a relay to one fixed upstream does not need
(URL objects, cookie jar, request/response classes, tracing hooks, timers, a stream reader with
its own buffering). This client is an `asyncio.Protocol` over a keep-alive pool, with httptools'
llhttp parser (the C parser uvicorn and vLLM's own server use): one write per request, response
bytes handed to the relay as they arrive, nothing parsed twice.

It answers the subset of `aiohttp.ClientResponse` the core uses (``status``, ``reason``,
``headers``, ``content_length``, ``content.iter_any()``, ``read()``, ``release()``, ``close()``)
and raises aiohttp's exception types, so the core treats both clients alike:

* connection refused / reset before the response: `aiohttp.ClientConnectionError` subclasses
  (`OSError` from connect, `aiohttp.ServerDisconnectedError`), a connect timeout:
  `asyncio.TimeoutError`; a silence longer than ``read_timeout_s``: `asyncio.TimeoutError`;
* a response cut mid-body: `aiohttp.ClientPayloadError`;
* ``close()`` before the end aborts the connection (vLLM then aborts the generation).

A pooled connection the upstream closed while idle is detected (it is dropped when the close
arrives, and idle ones are dropped after ``keepalive_s``, below uvicorn's 5 s). A request is
sent a second time only when it provably never reached the upstream's application: it was
written to a reused connection that the upstream then reset (a TCP RST: the peer closed with
the request unread in its buffer) before any byte of a response. An orderly close (FIN) after
the request went out is ambiguous (the upstream may have read it and begun generating), so it
gives 502 with ``x-should-retry: true`` and the client decides: a primary never generates twice
because of the proxy.

Plain ``http://`` upstreams only; the core uses aiohttp's client for anything else (https, a
connection limit, the non-LLM paths).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, AsyncIterator, Callable, Protocol

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy

HIGH_WATER = 1 << 18  # bytes buffered for a slow client before reading from the upstream pauses


class UpstreamCut(aiohttp.ClientPayloadError):
    """The upstream connection ended before the response did."""


class UpstreamDisconnected(aiohttp.ServerDisconnectedError):
    """The upstream closed the connection before a response; ``reset``: by a TCP reset."""

    def __init__(self, message: str, reset: bool = False) -> None:
        super().__init__(message)
        self.reset = reset


class UpstreamProtocolError(aiohttp.ClientResponseError):
    """The upstream sent something that is not HTTP/1.1."""

    def __init__(self, message: str) -> None:
        super().__init__(None, (), message=message)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"invalid HTTP response from the upstream: {self.message}"


class _Body(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...


class RelayedResponse(Protocol):
    """What the relay reads of an upstream's answer: an :class:`UpstreamResponse` (an LLM
    endpoint through the pool) or aiohttp's ``ClientResponse`` (everything else)."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def headers(self) -> CIMultiDictProxy[str]: ...
    @property
    def content_length(self) -> int | None: ...
    @property
    def content(self) -> _Body: ...
    async def read(self) -> bytes: ...
    def release(self) -> Any: ...
    def close(self) -> None: ...


class UpstreamResponse:
    """One response, read as it arrives (see the module docstring)."""

    __slots__ = ("_conn", "_loop", "_read_timeout", "status", "reason", "headers", "content_length",
                 "_raw_headers", "_reason", "_chunks", "_buffered", "_waiter", "_headers_waiter",
                 "_headers_done", "_complete", "_exc", "_keep_alive", "_until_eof", "_paused", "_released",
                 "_got_bytes", "_interim")

    def __init__(self, conn: "_Conn", loop: asyncio.AbstractEventLoop, read_timeout: float | None) -> None:
        self._conn = conn
        self._loop = loop
        self._read_timeout = read_timeout
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDictProxy[str] = _EMPTY
        self.content_length: int | None = None
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._headers_waiter: asyncio.Future | None = None
        self._headers_done = False
        self._complete = False
        self._exc: BaseException | None = None
        self._keep_alive = False
        self._until_eof = False
        self._paused = False
        self._released = False
        self._got_bytes = False
        self._interim = False

    # -- the relay's side ------------------------------------------------------------------------
    @property
    def content(self) -> "UpstreamResponse":
        return self

    def iter_any(self) -> "UpstreamResponse":
        return self

    def __aiter__(self) -> "UpstreamResponse":
        return self

    async def __anext__(self) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self._conn.resume()
                return data
            if self._exc is not None:
                raise self._exc
            if self._complete:
                raise StopAsyncIteration
            await self._wait()

    async def _wait(self) -> None:
        self._waiter = w = self._loop.create_future()
        try:
            if self._read_timeout:
                async with asyncio.timeout(self._read_timeout):
                    await w
            else:
                await w
        finally:
            self._waiter = None

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self]
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: a complete one gives its connection back to the pool."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.resp = None
        if self._complete and self._exc is None and self._keep_alive and not conn.closed:
            conn.pool._put(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """`release`; a response not read to its end aborts the connection (the upstream sees
        the client go away)."""
        self.release()

    # -- the protocol's side ---------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _on_headers(self, status: int, keep_alive: bool) -> None:
        if 100 <= status < 200:  # an interim response (100 Continue...): the real one follows
            self._interim = True
            self._raw_headers = []
            self._reason = b""
            return
        self.status = status
        self.reason = self._reason.decode("latin-1")
        h: CIMultiDict[str] = CIMultiDict()
        chunked = False
        length = None
        for name, value in self._raw_headers:
            n = name.decode("latin-1")
            v = value.decode("utf-8", "surrogateescape")
            h.add(n, v)
            low = n.lower()
            if low == "content-length":
                try:
                    length = int(v)
                except ValueError:
                    length = None
            elif low == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
        self._raw_headers = []
        self.headers = CIMultiDictProxy(h)
        self.content_length = length
        self._keep_alive = keep_alive
        self._until_eof = length is None and not chunked
        self._headers_done = True
        w = self._headers_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _on_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._complete or self._exc is not None:
            return
        self._exc = exc
        w = self._headers_waiter
        if w is not None and not w.done():
            w.set_exception(exc)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)  # __anext__ raises it after the buffered bytes


_EMPTY: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


class _Conn(asyncio.Protocol):
    """One keep-alive connection to the upstream; httptools calls the ``on_*`` methods."""

    def __init__(self, pool: "UpstreamPool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reading_paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp._released:  # bytes nobody asked for: the connection is unusable
            self.abort()
            return
        resp._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            resp._fail(UpstreamProtocolError("unexpected protocol upgrade"))
            self.abort()
        except httptools.HttpParserError as e:
            resp._fail(UpstreamProtocolError(str(e) or type(e).__name__))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._discard(self)
        resp = self.resp
        if resp is None or resp._complete:
            return
        if resp._headers_done and resp._until_eof and exc is None:
            resp._complete = True  # a body delimited by the end of the connection
            resp._wake()
            return
        what = f": {exc}" if exc else ""
        if resp._headers_done:
            resp._fail(UpstreamCut(f"the upstream closed the connection mid-response{what}"))
        else:
            resp._fail(UpstreamDisconnected(f"the upstream closed the connection before answering{what}",
                                            reset=isinstance(exc, ConnectionResetError)))

    def pause_writing(self) -> None:  # a request body larger than the socket buffer: the kernel copes
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks
    def on_status(self, status: bytes) -> None:
        if self.resp is not None:
            self.resp._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.resp is not None:
            self.resp._on_headers(self.parser.get_status_code(), self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(body)

    def on_message_complete(self) -> None:
        if self.resp is not None:
            self.resp._on_complete()

    # control
    def pause(self) -> None:
        if self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        self.pool._discard(self)
        if self.transport is not None:
            self.transport.abort()


#: How long a pooled upstream connection may stay idle before the proxy closes it: below vLLM's
#: keep-alive (uvicorn's ``timeout_keep_alive``, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s), so the
#: proxy, not the server, closes an idle connection, and a request is never written into a socket
#: the server is closing at that moment (the client would get a 502). Both of the core's clients
#: use it: this pool and aiohttp's (https, a connection limit, the non-LLM paths).
UPSTREAM_KEEPALIVE_S = 4.0


class UpstreamPool:
    """Keep-alive connections to one ``host:port`` and requests over them."""

    def __init__(self, host: str, port: int, *, connect_timeout_s: float = 10.0, read_timeout_s: float = 0.0,
                 keepalive_s: float = UPSTREAM_KEEPALIVE_S, max_idle: int = 1024) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s or None
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        host_header = f"[{host}]" if ":" in host else host
        self._host_line = f"Host: {host_header}:{port}\r\n".encode()
        self.closed = False

    # -- connections -----------------------------------------------------------------------------
    def _take(self) -> _Conn | None:
        idle = self._idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing() \
                    or now - conn.idle_since > self.keepalive_s:
                conn.abort()
                continue
            return conn
        return None

    def _put(self, conn: _Conn) -> None:
        if self.closed or len(self._idle) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _discard(self, conn: _Conn) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s or None):
            _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        self._all.add(conn)
        return conn

    def close(self) -> None:
        self.closed = True
        for conn in list(self._all) + self._idle:
            conn.abort()
        self._idle.clear()
        self._all.clear()

    # -- requests --------------------------------------------------------------------------------
    def head(self, method: str, target: str, headers: Any, length: int) -> bytes:
        """The request line and headers; ValueError for a header that would split the head."""
        parts = [f"{method} {target} HTTP/1.1\r\n".encode(), self._host_line]
        for name, value in headers.items():
            if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
                raise ValueError(f"invalid header {name!r}")
            parts.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        parts.append(b"Content-Length: %d\r\n\r\n" % length)
        return b"".join(parts)

    async def request(self, method: str, target: str, headers: Any, body: bytes,
                      on_sent: Callable[[], None] | None = None) -> UpstreamResponse:
        """Send one request; returns once the response's status and headers are in. ``on_sent``
        is called once the request is written (while the answer is awaited)."""
        head = self.head(method, target, headers, len(body))
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            conn = self._take()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            resp = UpstreamResponse(conn, loop, self.read_timeout_s)
            conn.resp = resp
            resp._headers_waiter = w = loop.create_future()
            assert conn.transport is not None
            if len(body) < 65536:
                conn.transport.write(head + body)
            else:
                conn.transport.write(head)
                conn.transport.write(body)
            if on_sent is not None:
                on_sent()
                on_sent = None
            try:
                if self.read_timeout_s:
                    async with asyncio.timeout(self.read_timeout_s):
                        await w
                else:
                    await w
            except UpstreamDisconnected as e:
                conn.abort()
                if reused and attempt == 0 and not resp._got_bytes and e.reset:
                    continue  # a kept-alive connection the upstream reset unread: once more, anew
                raise
            except BaseException:  # cancelled (the client went away), timed out, bad response
                conn.abort()
                raise
            finally:
                resp._headers_waiter = None
            return resp
        raise AssertionError("unreachable")  # pragma: no cover
