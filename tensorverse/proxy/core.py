"""The proxy core: relays every request to one upstream.

It knows nothing of recording, sessions or shadows (those are addons, `tensorverse.proxy.flow`).
What it guarantees:

* every path and method is relayed; status, body and end-to-end headers come back unchanged;
  hop-by-hop headers (RFC 9110 §7.6.1: ``Connection`` and the fields it names, ``Keep-Alive``,
  ``Proxy-Connection``, ``TE``, ``Transfer-Encoding``, ``Upgrade``, plus ``Trailer`` and the
  ``Proxy-Authenticate``/``Proxy-Authorization`` pair) are not forwarded in either direction;
* Server-Sent Events are relayed event by event as they arrive (never buffered), with
  ``X-Accel-Buffering: no``; no read timeout cuts a long stream unless configured;
* a client that goes away cancels the upstream request at once (the upstream connection is
  closed, which makes vLLM abort the generation) and the flow ends ``aborted``;
* an unreachable upstream gives an OpenAI-shaped (or Anthropic-shaped) 502 with
  ``x-should-retry: true``; a body over the limit gives 413;
* when addons changed the request (parameter injection) and the upstream rejects it with 400,
  the client's original body is sent instead, so injection can never break a request.

Clients reach it through the lean server of `tensorverse.proxy.http` (an asyncio protocol over
llhttp, with aiohttp's request/response names). LLM requests (``flow.kind`` set) reach a
plain-HTTP upstream through the lean client of `tensorverse.proxy.upstream` (same interface and
exceptions as aiohttp's, half the work per request); everything else, and https or a
``max_connections`` limit, through aiohttp's client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterable, NamedTuple

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from tensorverse.proxy import http
from tensorverse.proxy.flow import ABORTED, ERROR, OK, PENDING, UPSTREAM_ERROR, Addon, Flow, overrides
from tensorverse.proxy.protocol import endpoint_kind, error_body
from tensorverse.proxy.sse import SSEParser, SSESplitter, first_event_end
from tensorverse.proxy import upstream as upstream_module  # its UPSTREAM_KEEPALIVE_S, read at start
from tensorverse.proxy.upstream import RelayedResponse, UpstreamPool


class _ServerLimits(NamedTuple):
    """The client-facing server's limits (``http.Server``'s arguments)."""

    head_timeout_s: float
    body_timeout_s: float
    max_connections: int


log = logging.getLogger("tensorverse.proxy")

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authenticate",
        "proxy-authorization",
    }
)
# Set by aiohttp itself for the next hop.
_REQUEST_DROP = frozenset({"host", "content-length", "expect"})
_RESPONSE_DROP = frozenset({"content-length"})


def _hop_by_hop(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    names = set(HOP_BY_HOP)
    for value in headers.getall("connection", ()):
        for token in value.split(","):
            token = token.strip().lower()
            if token:
                names.add(token)
    return names


def forward_request_headers(
    headers: CIMultiDictProxy[str], *, drop_prefixes: Iterable[str] = (), identity: bool = False
) -> CIMultiDict[str]:
    """The client's headers as they go upstream (end-to-end ones only)."""
    skip = _hop_by_hop(headers) | _REQUEST_DROP
    prefixes = tuple(p.lower() for p in drop_prefixes)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        low = name.lower()
        if low in skip or (prefixes and low.startswith(prefixes)):
            continue
        if identity and low == "accept-encoding":
            continue
        out.add(name, value)
    if identity:
        out["Accept-Encoding"] = "identity"
    return out


def forward_response_headers(headers: CIMultiDictProxy[str], *, keep_length: bool) -> CIMultiDict[str]:
    skip = _hop_by_hop(headers)
    if not keep_length:
        skip |= _RESPONSE_DROP
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in skip:
            out.add(name, value)
    return out


class _BodyTooLarge(Exception):
    pass


class ProxyCore:
    """Relays requests to ``upstream`` (``http://host:port[/base]``) through ``addons``.

    ``responses`` holds the response classes the core builds (``Response``, ``StreamResponse``):
    `tensorverse.proxy.http`'s, which serves clients; a server of another kind (the ASGI
    adapter that ``benchmarks/proxy_overhead.py`` measures against it) supplies its own."""

    responses: Any = http

    def __init__(
        self,
        upstream: str,
        addons: list[Addon] | None = None,
        *,
        max_body_bytes: int = 32 << 20,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 0.0,
        upstream_prefix: str = "/upstream",
        max_connections: int = 0,
        strip_header_prefixes: tuple[str, ...] = ("x-tensorverse-",),
        retry_without_injection: bool = True,
        head_timeout_s: float = http.HEAD_TIMEOUT_S,
        body_timeout_s: float = http.BODY_TIMEOUT_S,
        max_client_connections: int = http.MAX_CONNECTIONS,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.addons = list(addons or [])
        self.max_body_bytes = max_body_bytes
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.upstream_prefix = upstream_prefix
        self.max_connections = max_connections
        self.strip_header_prefixes = strip_header_prefixes
        self.retry_without_injection = retry_without_injection
        self._server_limits = _ServerLimits(head_timeout_s, body_timeout_s, max_client_connections)
        self._client: aiohttp.ClientSession | None = None
        # LLM endpoints go through the lean client (tensorverse.proxy.upstream) where it applies:
        # a plain-HTTP upstream without a connection limit.
        self._pool: UpstreamPool | None = None
        u = URL(self.upstream)
        self._base_path = u.raw_path.rstrip("/") if u.raw_path not in ("", "/") else ""
        self._lean = (u.scheme == "http" and not max_connections and bool(u.host) and not u.user
                      and not u.raw_query_string and not u.raw_fragment)
        self._upstream_hostport = (u.host or "", u.port or 80)
        self._server: http.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.in_flight = 0  # requests whose response is not finished (a graceful stop waits)
        self._idle = asyncio.Event()
        self._idle.set()
        self._hooks = {
            h: [a for a in self.addons if overrides(a, h)]
            for h in ("request", "request_forwarded", "response_start", "stream_rewrite", "event", "stream_data",
                      "response_body", "response_done", "error")
        }
        self.counters: dict[str, int] = {
            "requests": 0,
            "turns": 0,
            "streams": 0,
            "aborted": 0,
            "upstream_unreachable": 0,
            "upstream_cut": 0,
            "upstream_status_4xx": 0,
            "upstream_status_5xx": 0,
            "body_too_large": 0,
            "requests_refused": 0,
            "connections_evicted": 0,
            "retried_without_injection": 0,
            "addon_errors": 0,
        }
        self.port: int | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def _on_startup(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0,
                                        keepalive_timeout=upstream_module.UPSTREAM_KEEPALIVE_S)
        self._client = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=self.connect_timeout_s,
                sock_read=self.read_timeout_s or None,
            ),
        )
        if self._lean:
            host, port = self._upstream_hostport
            self._pool = UpstreamPool(host, port, connect_timeout_s=self.connect_timeout_s,
                                      read_timeout_s=self.read_timeout_s,
                                      keepalive_s=upstream_module.UPSTREAM_KEEPALIVE_S)
        for a in self.addons:
            await a.start()

    async def _on_cleanup(self) -> None:
        await self.drain(5.0)
        for a in reversed(self.addons):
            try:
                await a.stop()
            except Exception:
                log.exception("addon %s failed to stop", a.name)
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on host:port (0 = any free port); returns the port."""
        await self._on_startup()
        lim = self._server_limits
        server = http.Server(self.handle, head_timeout_s=lim.head_timeout_s, body_timeout_s=lim.body_timeout_s,
                             max_connections=lim.max_connections, error_body=lambda status, message: error_body(
            None, status, message, "BadRequest" if status < 500 else "InternalServerError"))
        try:
            self.port = await server.start(host, port, backlog=1024)
        except BaseException:  # e.g. the address is taken: nothing started is left running
            await self._on_cleanup()
            raise
        self._server = server
        return self.port

    def stop_listening(self) -> None:
        """New connections are refused; requests in flight go on (a graceful stop's first step)."""
        if self._server is not None:
            self._server.stop_listening()

    async def close(self, timeout: float = 5.0) -> None:
        """Stop serving: requests still in flight after ``timeout`` seconds are cut; then the
        background hooks get 5 s and the addons stop."""
        if self._server is not None:
            server, self._server = self._server, None
            await server.close(timeout)
            await self._on_cleanup()

    async def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) for background hook tasks."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    def stats(self) -> dict[str, Any]:
        if self._server is not None:
            self.counters["requests_refused"] = self._server.refused
            self.counters["connections_evicted"] = self._server.evicted
        out: dict[str, Any] = {"proxy": dict(self.counters), "background_tasks": len(self._tasks)}
        for a in self.addons:
            try:
                s = a.stats()
            except Exception:  # noqa: BLE001
                s = {}
            if s:
                out[a.name] = s
        return out

    # -- hooks -----------------------------------------------------------------------------------
    def _hook_failed(self, addon: Addon, hook: str) -> None:
        self.counters["addon_errors"] += 1
        log.exception("addon %s failed in %s", addon.name, hook)

    def _background(self, flow: Flow, hook: str) -> None:
        addons = self._hooks[hook]
        if not addons:
            return

        async def run() -> None:
            for a in addons:
                try:
                    await getattr(a, hook)(flow)
                except Exception:  # noqa: BLE001
                    self._hook_failed(a, hook)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- request handling ------------------------------------------------------------------------
    async def _read_body(self, request: http.Request) -> bytes:
        cl = request.content_length
        if cl is not None and cl > self.max_body_bytes:
            raise _BodyTooLarge
        if not request.body_exists:
            return b""
        if request.content.done:  # the usual case: the whole body came with the headers
            body = request.content.read_nowait()
            if len(body) > self.max_body_bytes:
                raise _BodyTooLarge
            return body
        parts = bytearray()
        async for chunk in request.content.iter_any():
            parts += chunk
            if len(parts) > self.max_body_bytes:
                raise _BodyTooLarge
        return bytes(parts)

    def _error(self, kind: str | None, status: int, message: str, err_type: str, retry: bool | None = None) -> http.Response:
        headers = {"Content-Type": "application/json"}
        if retry is not None:
            headers["x-should-retry"] = "true" if retry else "false"
        return self.responses.Response(status=status, body=error_body(kind, status, message, err_type), headers=headers)

    def _upstream_target(self, request: http.Request) -> str:
        """The request target on the upstream (below its base path). ``raw_path`` is a path
        (origin form: the server reduces an absolute-form target to it and refuses the rest),
        so the upstream's scheme and host are the only ones a request can reach."""
        raw = request.raw_path
        p = self.upstream_prefix
        if p and (raw == p or raw.startswith(p + "/") or raw.startswith(p + "?")):
            raw = raw[len(p):] or "/"
            if raw.startswith("?"):
                raw = "/" + raw
        return raw

    def _upstream_url(self, request: http.Request) -> str:
        return self.upstream + self._upstream_target(request)

    async def handle(self, request: http.Request) -> http.StreamResponse:
        self.in_flight += 1
        self._idle.clear()
        try:
            return await self._handle(request)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Until no request is in flight (at most ``timeout`` seconds); True when none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout, 0.0))
        except asyncio.TimeoutError:
            pass
        return self.in_flight == 0

    async def _handle(self, request: http.Request) -> http.StreamResponse:
        self.counters["requests"] += 1
        kind = endpoint_kind(request.method, request.path)
        if not request.raw_path.startswith("/"):  # the server guarantees it; never trust a caller
            return self._error(kind, 400, "the request target must be a path", "BadRequest", retry=False)
        try:
            body = await self._read_body(request)
        except _BodyTooLarge:
            self.counters["body_too_large"] += 1
            resp = self._error(
                kind, 413, f"request body exceeds the proxy's limit of {self.max_body_bytes} bytes",
                "RequestEntityTooLarge", retry=False,
            )
            resp.force_close()  # the rest of the body is never read
            return resp
        flow = Flow(request.method, request.path, request.query_string, request.headers, body, kind=kind)
        if kind is not None:
            self.counters["turns"] += 1
        try:
            return await self._exchange(request, flow)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away (the server cancels the handler, or a response could not
            # begin): the upstream request has been closed on the way out (`_exchange`).
            if flow.state == PENDING:
                flow.state = ABORTED
                flow.error = "client disconnected"
                flow.t_end = time.perf_counter()
                self.counters["aborted"] += 1
                if kind is not None:
                    self._forwarded(flow)
                    self._background(flow, "error")
            raise

    async def _exchange(self, request: http.Request, flow: Flow) -> http.StreamResponse:
        kind = flow.kind
        if kind is not None:
            for a in self._hooks["request"]:
                try:
                    await a.request(flow)
                except Exception:  # noqa: BLE001
                    self._hook_failed(a, "request")
        assert self._client is not None
        headers = forward_request_headers(
            request.headers, drop_prefixes=self.strip_header_prefixes, identity=kind is not None
        )
        pool = self._pool if kind is not None else None
        if pool is not None:
            target = self._base_path + self._upstream_target(request)
        else:
            url = URL(self._upstream_url(request), encoded=True)
            if kind is not None:
                self._forwarded(flow)  # aiohttp's client has no "sent" point: before the request
        send_body = flow.upstream_body
        on_sent = (lambda: self._forwarded(flow)) if kind is not None else None
        up: RelayedResponse
        for attempt in (0, 1):
            try:
                if pool is not None:
                    up = await pool.request(request.method, target, headers, send_body, on_sent)
                else:
                    up = await self._client.request(
                        request.method, url, headers=headers,
                        data=send_body if send_body or request.body_exists else None, allow_redirects=False,
                    )
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                self.counters["upstream_unreachable"] += 1
                return self._fail(flow, 502 if not isinstance(e, asyncio.TimeoutError) else 504,
                                  f"upstream {self.upstream} unreachable: {_describe(e)}")
            if (
                attempt == 0
                and self.retry_without_injection
                and send_body is not flow.body
                and up.status in (400, 422)
            ):
                # The upstream rejected the request as the proxy changed it: send the client's own.
                detail = await _safe_read(up)
                up.release()
                log.warning("upstream rejected the injected request (%s): %s; resending the client's body",
                            up.status, detail[:300].decode("utf-8", "replace"))
                self.counters["retried_without_injection"] += 1
                flow.retried_without_injection = True
                flow.upstream_rejection = detail[:2000].decode("utf-8", "replace")
                flow.injected = {}
                send_body = flow.body
                continue
            break
        try:
            return await self._relay(request, flow, up)
        finally:
            up.close()  # no-op after a complete read; aborts the upstream request otherwise

    def _forwarded(self, flow: Flow) -> None:
        """Run the `request_forwarded` hooks of a flow, once."""
        if flow.forwarded:
            return
        flow.forwarded = True
        for a in self._hooks["request_forwarded"]:
            try:
                a.request_forwarded(flow)
            except Exception:  # noqa: BLE001
                self._hook_failed(a, "request_forwarded")

    def _fail(self, flow: Flow, status: int, message: str) -> http.Response:
        flow.state = ERROR
        flow.error = message
        flow.status = status
        flow.t_end = time.perf_counter()
        if flow.kind is not None:
            self._forwarded(flow)
            self._background(flow, "error")
        log.warning("%s %s: %s", flow.method, flow.path, message)
        return self._error(flow.kind, status, message, "BadGateway" if status == 502 else "GatewayTimeout", retry=True)

    async def _relay(self, request: http.Request, flow: Flow, up: RelayedResponse) -> http.StreamResponse:
        if flow.kind is not None:
            self._forwarded(flow)  # normally done already, once the request was written
        flow.status = up.status
        flow.response_headers = up.headers
        flow.t_headers = time.perf_counter()
        ctype = up.headers.get("Content-Type", "")
        flow.stream = ctype.startswith("text/event-stream")
        if up.status >= 500:
            self.counters["upstream_status_5xx"] += 1
        elif up.status >= 400:
            self.counters["upstream_status_4xx"] += 1
        hooks = flow.kind is not None
        if hooks:
            for a in self._hooks["response_start"]:
                try:
                    a.response_start(flow)
                except Exception:  # noqa: BLE001
                    self._hook_failed(a, "response_start")

        encoded = "Content-Encoding" in up.headers
        if hooks and not flow.stream and not encoded:
            return await self._relay_whole(request, flow, up)
        if hooks and flow.stream and not encoded:
            return await self._relay_events(request, flow, up)
        return await self._relay_bytes(request, flow, up)

    async def _relay_whole(self, request: http.Request, flow: Flow, up: RelayedResponse) -> http.StreamResponse:
        try:
            flow.response_body = await up.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self.counters["upstream_cut"] += 1
            return self._fail(flow, 502, f"upstream {self.upstream} failed mid-response: {_describe(e)}")
        for a in self._hooks["response_body"]:
            try:
                a.response_body(flow)
            except Exception:  # noqa: BLE001
                self._hook_failed(a, "response_body")
        resp = self.responses.Response(
            status=up.status, reason=up.reason, body=flow.response_body,
            headers=forward_response_headers(up.headers, keep_length=False),
        )
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except ConnectionResetError:  # the client left before the body went out
            return self._client_gone(flow, resp)
        self._finish(flow)
        return resp

    async def _relay_events(self, request: http.Request, flow: Flow, up: RelayedResponse) -> http.StreamResponse:
        self.counters["streams"] += 1
        headers = forward_response_headers(up.headers, keep_length=False)
        headers["X-Accel-Buffering"] = "no"
        resp = self.responses.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        await resp.prepare(request)
        splitter = SSESplitter()
        rewriters = self._hooks["stream_rewrite"]
        event_hooks = self._hooks["event"]
        observers = self._hooks["stream_data"]
        perf_counter = time.perf_counter
        ended = False  # the stream's last event ([DONE], Anthropic's message_stop) went out
        try:
            async for chunk in up.content.iter_any():
                data = splitter.feed(chunk)  # complete events only; the rest waits for more
                if not data:
                    continue
                runs: tuple[bytes, ...] = (data,)
                if flow.t_first_event is None:  # the first event goes out on its own: the
                    cut = first_event_end(data)  # client's first token does not wait while
                    if cut < len(data):  # the events read with it are rewritten
                        runs = (data[:cut], data[cut:])
                for data in runs:
                    t = perf_counter()
                    if flow.t_first_event is None:
                        flow.t_first_event = t
                    flow.t_last_event = t
                    out = data
                    for a in rewriters:
                        try:
                            out = a.stream_rewrite(flow, out)
                        except Exception:  # noqa: BLE001
                            self._hook_failed(a, "stream_rewrite")
                    if event_hooks:
                        out = self._event_hooks(flow, event_hooks, out)
                    await resp.write(out)
                    # The client has the bytes: now whatever records them.
                    for a in observers:
                        try:
                            a.stream_data(flow, data, t)
                        except Exception:  # noqa: BLE001
                            self._hook_failed(a, "stream_data")
                    if not ended and (b"[DONE]" in data or b"message_stop" in data):
                        ended = True
        except ConnectionResetError as e:  # a write to the client, or the upstream reset: whose side?
            if not _client_closed(request):
                return self._cut(request, flow, resp, e)
            # A client that closes once it has the last event (the openai client does) has the
            # whole turn: it is recorded as complete, not aborted.
            return self._finish_or_gone(flow, resp, ended)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return self._cut(request, flow, resp, e)
        except asyncio.CancelledError:
            if ended:
                self._finish(flow)
            raise
        tail = splitter.tail()
        try:
            if tail:
                flow.sse_tail = tail
                await resp.write(tail)
            await resp.write_eof()
        except ConnectionResetError:  # every event went out; only the stream's end did not
            return self._finish_or_gone(flow, resp, True)
        self._finish(flow)
        return resp

    def _finish_or_gone(self, flow: Flow, resp: http.StreamResponse, ended: bool) -> http.StreamResponse:
        if not ended:
            return self._client_gone(flow, resp)
        self._finish(flow)
        resp.force_close()
        return resp

    def _event_hooks(self, flow: Flow, hooks: list[Addon], data: bytes) -> bytes:
        """Addons that override `Addon.event` see (and may change) each event."""
        events = SSEParser().feed(data)
        for ev in events:
            for a in hooks:
                try:
                    a.event(flow, ev)
                except Exception:  # noqa: BLE001
                    self._hook_failed(a, "event")
        return b"".join(ev.raw for ev in events)

    async def _relay_bytes(self, request: http.Request, flow: Flow, up: RelayedResponse) -> http.StreamResponse:
        keep_length = up.content_length is not None and "chunked" not in up.headers.get("Transfer-Encoding", "")
        headers = forward_response_headers(up.headers, keep_length=keep_length)
        if flow.stream:
            headers["X-Accel-Buffering"] = "no"
        resp = self.responses.StreamResponse(status=up.status, reason=up.reason, headers=headers)
        if keep_length:
            resp.content_length = up.content_length
        await resp.prepare(request)
        try:
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionResetError as e:
            if not _client_closed(request):
                return self._cut(request, flow, resp, e)
            return self._client_gone(flow, resp)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return self._cut(request, flow, resp, e)
        self._finish(flow)
        return resp

    def _finish(self, flow: Flow) -> None:
        flow.t_end = time.perf_counter()
        flow.state = OK if (flow.status or 0) < 400 else UPSTREAM_ERROR
        if flow.kind is not None:
            self._background(flow, "response_done")

    def _cut(self, request: http.Request, flow: Flow, resp: http.StreamResponse, e: BaseException) -> http.StreamResponse:
        """The upstream failed after the headers went out: end the client's connection abruptly
        (as the upstream did) so the client sees an incomplete response, not a clean end."""
        self.counters["upstream_cut"] += 1
        flow.state = ERROR
        flow.error = f"upstream failed mid-response: {_describe(e)}"
        flow.t_end = time.perf_counter()
        log.warning("%s %s: %s", flow.method, flow.path, flow.error)
        if flow.kind is not None:
            self._background(flow, "error")
        resp.force_close()
        if request.transport is not None:
            request.transport.abort()
        return resp

    def _client_gone(self, flow: Flow, resp: http.StreamResponse) -> http.StreamResponse:
        if flow.state == PENDING:
            flow.state = ABORTED
            flow.error = "client disconnected"
            flow.t_end = time.perf_counter()
            self.counters["aborted"] += 1
            if flow.kind is not None:
                self._background(flow, "error")
        resp.force_close()
        return resp


def _client_closed(request: http.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


async def _safe_read(up: RelayedResponse) -> bytes:
    try:
        return await up.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return b""


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text
