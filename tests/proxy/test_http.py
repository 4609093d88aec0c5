"""The client-facing server (tensorverse.proxy.http) on its own, spoken to over raw sockets: the
framing a client gets (keep-alive, pipelining, chunked, HTTP/1.0, HEAD), refusals, flow
control, cancellation and shutdown. The core's behaviour through it is in test_passthrough."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from tensorverse.proxy import http


class Served:
    """A `http.Server` on the test loop with ``handler``; records what the handlers saw."""

    def __init__(self, loop, handler, **kw) -> None:
        self.loop = loop
        self.seen: list[tuple[str, str, str, bytes]] = []
        self.cancelled = 0
        self.finished = 0

        async def wrapped(req: http.Request) -> http.StreamResponse:
            try:
                return await handler(self, req)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.finished += 1

        self.server = http.Server(wrapped, **kw)
        self.port = loop.run(self.server.start("127.0.0.1", 0))

    def close(self, timeout: float = 1.0) -> None:
        self.loop.run(self.server.close(timeout))

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return s


@pytest.fixture
def served(loop):
    made: list[Served] = []

    def make(handler, **kw) -> Served:
        s = Served(loop, handler, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


async def echo(srv: Served, req: http.Request) -> http.StreamResponse:
    body = await req.content.read()
    srv.seen.append((req.method, req.path, req.query_string, body))
    return http.Response(body=b"%s %s %d" % (req.method.encode(), req.raw_path.encode(), len(body)),
                         headers={"Content-Type": "text/plain"})


async def stream(srv: Served, req: http.Request) -> http.StreamResponse:
    await req.content.read()
    resp = http.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(req)
    for i in range(3):
        await resp.write(b"data: %d\n\n" % i)
    await resp.write_eof()
    return resp


def read_until_closed(s: socket.socket, timeout: float = 10) -> bytes:
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            return out
        if not data:
            return out
        out += data


_pending: dict[int, bytes] = {}  # bytes read past a response, per socket


def read_response(s: socket.socket) -> bytes:
    """One response with Content-Length or chunked framing, read exactly (what follows it is
    kept for the next call)."""
    s.settimeout(10)
    buf = _pending.pop(s.fileno(), b"")
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    headers = {line.split(b":", 1)[0].strip().lower(): line.split(b":", 1)[1].strip()
               for line in head.split(b"\r\n")[1:]}
    if b"content-length" in headers:
        n = int(headers[b"content-length"])
        while len(rest) < n:
            rest += s.recv(65536)
        body, after = rest[:n], rest[n:]
    else:
        while b"\r\n0\r\n\r\n" not in rest and not rest.startswith(b"0\r\n\r\n"):
            rest += s.recv(65536)
        end = rest.index(b"0\r\n\r\n", rest.index(b"\r\n0\r\n\r\n") + 2 if b"\r\n0\r\n\r\n" in rest else 0) + 5
        body, after = rest[:end], rest[end:]
    if after:
        _pending[s.fileno()] = after
    return head + b"\r\n\r\n" + body


def test_keep_alive_and_pipelined_requests_are_answered_in_order(served):
    srv = served(echo)
    s = srv.connect()
    s.sendall(b"POST /a?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
              b"GET /b%20c HTTP/1.1\r\nHost: h\r\n\r\n"
              b"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n3\r\n!!!\r\n0\r\n\r\n")
    answers = [read_response(s) for _ in range(3)]
    assert answers[0].endswith(b"\r\n\r\nPOST /a?x=1 3") and answers[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert answers[1].endswith(b"GET /b%20c 0")
    assert answers[2].endswith(b"POST /c 5")
    assert all(b"\r\ndate: " in a.lower() for a in answers) and not any(b"connection: close" in a.lower()
                                                                        for a in answers)
    assert srv.seen == [("POST", "/a", "x=1", b"abc"), ("GET", "/b c", "", b""), ("POST", "/c", "", b"hi!!!")]
    s.close()


def test_streamed_response_is_chunked_and_the_connection_is_reused(served):
    srv = served(stream)
    s = srv.connect()
    for _ in range(2):
        s.sendall(b"POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}")
        r = read_response(s)
        assert b"transfer-encoding: chunked" in r.lower()
        assert r.endswith(b"\r\n\r\n9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n")
    s.close()
    with httpx.Client() as c:  # and a real client reads the same
        assert c.post(f"http://127.0.0.1:{srv.port}/s", content=b"{}").text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_a_stream_head_goes_out_before_the_first_event_is_there(served):
    release = asyncio.Event()

    async def slow_first(srv, req):
        resp = http.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        await release.wait()  # a long prefill: the client has the status and headers meanwhile
        await resp.write(b"data: 1\n\n")
        return resp

    srv = served(slow_first)
    s = srv.connect()
    s.sendall(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    s.settimeout(5)
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(65536)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    rest = head.split(b"\r\n\r\n", 1)[1]
    assert rest == b""  # nothing of the body yet
    srv.loop.call(release.set)
    while not rest.endswith(b"0\r\n\r\n"):
        rest += s.recv(65536)
    assert rest == b"9\r\ndata: 1\n\n\r\n0\r\n\r\n"


def test_http10_stream_ends_with_the_connection_and_head_has_no_body(served):
    srv = served(stream)
    s = srv.connect()
    s.sendall(b"GET /s HTTP/1.0\r\n\r\n")
    r = read_until_closed(s)
    assert r.startswith(b"HTTP/1.1 200 OK\r\n") and b"chunked" not in r.lower()
    assert b"connection: close" in r.lower() and r.endswith(b"\r\n\r\ndata: 0\n\ndata: 1\n\ndata: 2\n\n")
    srv2 = served(echo)
    s = srv2.connect()
    s.sendall(b"HEAD /h HTTP/1.1\r\nHost: h\r\n\r\nGET /after HTTP/1.1\r\nHost: h\r\n\r\n")
    time.sleep(0.3)
    data = b""
    s.settimeout(5)
    while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"GET /after 0"):
        data += s.recv(65536)
    first, second = data.split(b"HTTP/1.1 200", 2)[1:]
    assert first.endswith(b"\r\n\r\n") and b"content-length: 9" in first.lower()  # no body after HEAD
    assert second.endswith(b"GET /after 0")


def test_expect_100_continue_is_answered_when_the_body_is_read(served):
    srv = served(echo)
    s = srv.connect()
    s.sendall(b"POST /e HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
    s.settimeout(5)
    assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
    s.sendall(b"body")
    assert read_response(s).endswith(b"POST /e 4")


@pytest.mark.parametrize("request_bytes,status", [
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: h\r\n\r\n", 414),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"h" * 9000 + b"\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n", 431),
    (b"GET / HTTP/1.1\r\nHost h\r\n\r\n", 400),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),  # a TLS hello
])
def test_requests_the_server_cannot_take_are_refused_and_the_connection_closes(served, request_bytes, status):
    srv = served(echo)
    s = srv.connect()
    s.sendall(b"GET /ok HTTP/1.1\r\nHost: h\r\n\r\n" + request_bytes)
    data = read_until_closed(s)
    ok, _, refusal = data.partition(b"GET /ok 0")
    assert ok.startswith(b"HTTP/1.1 200 OK")  # the request before it is answered first
    assert refusal.startswith(b"HTTP/1.1 %d " % status) and b"connection: close" in refusal.lower()
    assert b'"error"' in refusal
    assert [x[1] for x in srv.seen] == ["/ok"]


def test_a_header_that_never_ends_is_refused_without_buffering_it(served):
    srv = served(echo)
    s = srv.connect()
    s.sendall(b"GET / HTTP/1.1\r\nHost: h\r\nX-Endless: ")
    sent = 0
    try:
        while sent < 4 << 20:
            s.sendall(b"v" * 16384)
            sent += 16384
            time.sleep(0.001)
    except (BrokenPipeError, ConnectionResetError):
        pass
    data = read_until_closed(s)
    assert sent < 4 << 20  # refused long before the end
    assert data == b"" or data.startswith(b"HTTP/1.1 431 ")
    assert srv.seen == []


def test_a_broken_chunked_body_fails_the_handlers_read_and_aborts(served):
    srv = served(echo)
    s = srv.connect()
    s.sendall(b"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\nzz\r\n")
    assert read_until_closed(s) == b""
    assert srv.seen == [] and srv.finished == 1


def test_handler_error_gives_500_and_closes(served):
    async def boom(srv, req):
        raise RuntimeError("bug")

    srv = served(boom)
    s = srv.connect()
    s.sendall(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    data = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 500 Internal Server Error\r\n") and b"connection: close" in data.lower()


def test_handler_error_after_the_response_began_cuts_the_connection(served):
    async def half(srv, req):
        resp = http.StreamResponse()
        await resp.prepare(req)
        await resp.write(b"data: 1\n\n")
        raise RuntimeError("bug mid-stream")

    srv = served(half)
    s = srv.connect()
    s.sendall(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    data = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"9\r\ndata: 1\n\n\r\n")
    assert b" 500 " not in data and not data.endswith(b"0\r\n\r\n")  # no clean end, no second head


def test_client_going_away_cancels_the_handler(served):
    started = asyncio.Event()

    async def hang(srv, req):
        started.set()
        await asyncio.sleep(60)
        return http.Response()

    srv = served(hang)
    s = srv.connect()
    s.sendall(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    srv.loop.run(asyncio.wait_for(started.wait(), 5))
    s.close()
    deadline = time.monotonic() + 2
    while not srv.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.cancelled == 1


def test_a_slow_reader_makes_write_wait(served):
    progress = {"written": 0}

    async def big(srv, req):
        resp = http.StreamResponse()
        await resp.prepare(req)
        for _ in range(400):
            await resp.write(b"x" * 65536)
            progress["written"] += 1
        await resp.write_eof()
        return resp

    srv = served(big)
    s = srv.connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    s.sendall(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    time.sleep(1.0)  # nothing read: the writes stop at the socket buffers plus the high-water mark
    assert progress["written"] < 100, progress
    total = 0
    s.settimeout(10)
    while not total or progress["written"] < 400 or total < 400 * 65536:
        data = s.recv(1 << 20)
        if not data:
            break
        total += len(data)
        if data.endswith(b"0\r\n\r\n") and progress["written"] == 400:
            break
    assert progress["written"] == 400 and total > 400 * 65536


def test_idle_connections_close_after_the_keepalive_time(served):
    srv = served(echo, keepalive_s=0.3)
    s = srv.connect()
    s.sendall(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert read_response(s).endswith(b"GET / 0")
    t0 = time.monotonic()
    assert read_until_closed(s) == b""
    assert time.monotonic() - t0 < 3


def test_close_waits_for_busy_connections_then_cuts_them(loop, served):
    async def slow(srv, req):
        await asyncio.sleep(float(req.path.strip("/")))
        return http.Response(body=b"done")

    srv = served(slow)
    fast, stuck, idle = srv.connect(), srv.connect(), srv.connect()
    fast.sendall(b"GET /0.2 HTTP/1.1\r\nHost: h\r\n\r\n")
    stuck.sendall(b"GET /30 HTTP/1.1\r\nHost: h\r\n\r\n")
    time.sleep(0.1)
    t0 = time.monotonic()
    srv.close(timeout=1.0)
    took = time.monotonic() - t0
    assert 0.9 < took < 3
    assert read_response(fast).endswith(b"done")  # finished within the time given
    assert b"done" not in read_until_closed(stuck)  # cut
    assert read_until_closed(idle) == b""
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=2)


def test_core_on_a_taken_port_fails_to_start_and_leaves_nothing_running(loop):
    from tensorverse.proxy.core import ProxyCore

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    core = ProxyCore("http://127.0.0.1:9")
    with pytest.raises(OSError):
        loop.run(core.start("127.0.0.1", taken.getsockname()[1]))
    assert core._client is None and core._server is None  # the upstream client was closed again
    taken.close()


def test_an_unread_body_pauses_the_socket_and_arrives_whole_once_read(served):
    release = asyncio.Event()
    paused: list[tuple[bool, int]] = []

    async def late_reader(srv, req):
        await release.wait()
        body = await req.content.read()
        return http.Response(body=b"%d %d" % (len(body), body.count(b"x")))

    srv = served(late_reader)
    s = srv.connect()
    size = 48 << 20  # more than the kernel's socket buffers on both sides hold
    s.sendall(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % size)
    sender = threading.Thread(target=s.sendall, args=(b"x" * size,))
    sender.start()
    time.sleep(1.0)
    srv.loop.call(lambda: paused.extend((c._reading_paused, c._buffered()) for c in srv.server._connections))
    assert sender.is_alive()  # the proxy stopped reading; the client waits
    assert paused[0][0] is True and paused[0][1] < 2 * http.BODY_HIGH_WATER  # the unread part is bounded
    srv.loop.call(release.set)
    sender.join(10)
    assert read_response(s).endswith(b"%d %d" % (size, size))
