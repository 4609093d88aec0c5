"""The proxy's HTTP edge as an attacker sees it, over raw sockets: targets that name another host,
transfer codings the proxy cannot undo, slow clients, too many connections, and requests that
must never reach the primary twice. Each test failed on the code before its fix (commit message).

The upstream is a thread that records every request it receives byte for byte, so a test can say
exactly what reached the primary."""

from __future__ import annotations

import select
import socket
import threading
import time

import httpx
import pytest

from tensorverse.proxy.core import ProxyCore

OK = b'{"id":"x","object":"chat.completion","choices":[]}'
CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def answer(body: bytes = OK) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


class Recorder:
    """A raw HTTP/1.1 upstream in a thread: records (request line, headers, body) of every request
    it reads whole; ``script(n, conn_requests)`` says what to do with the n-th request (n from 1):
    "answer", "close" (read it, then close without a response: FIN) or "reset-unread" (do not read
    it; close with it unread, which makes the kernel send a reset)."""

    def __init__(self, script=lambda n, k: "answer") -> None:
        self.script = script
        self.requests: list[tuple[bytes, dict[bytes, bytes], bytes]] = []
        self.connections = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = False
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        served = 0
        try:
            while True:
                if not buf:
                    select.select([conn], [], [], 30)
                    if self.script(len(self.requests) + 1, served) == "reset-unread":
                        conn.close()  # the request is unread in the kernel's buffer: a reset
                        return
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                line, *fields = head.split(b"\r\n")
                headers = {}
                for f in fields:
                    name, _, value = f.partition(b":")
                    headers[name.strip().lower()] = value.strip()
                n = int(headers.get(b"content-length", b"0"))
                while len(buf) < n:
                    buf += conn.recv(65536)
                body, buf = buf[:n], buf[n:]
                self.requests.append((line, headers, body))
                served += 1
                if self.script(len(self.requests), served) == "close":
                    conn.close()
                    return
                conn.sendall(answer())
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture
def edge(loop):
    """edge(script=..., **core options) -> (proxy base URL, Recorder, ProxyCore)."""
    made: list[tuple[ProxyCore, Recorder]] = []

    def make(script=lambda n, k: "answer", **kw):
        up = Recorder(script)
        core = ProxyCore(up.url, **kw)
        port = loop.run(core.start())
        made.append((core, up))
        return port, up, core

    yield make
    for core, up in made:
        loop.run(core.close(1.0))
        up.close()


def exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes on a new connection; everything the proxy answers until it closes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                return out
            if not chunk:
                return out
            out += chunk
    finally:
        s.close()


# -- targets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [b"http://evil.example/v1/models", b"a://x/v1/models",
                                    b"http://evil.example:8080/v1/models?x=1", b"HTTPS://127.0.0.2/v1/models"])
def test_an_absolute_form_target_reaches_only_the_upstream_with_its_path(edge, target):
    port, up, _ = edge()
    data = exchange(port, b"GET " + target + b" HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    (line, headers, _), = up.requests
    path = target.split(b"/v1/models", 1)[1]
    assert line == b"GET /v1/models" + path + b" HTTP/1.1"
    assert headers[b"host"] == b"127.0.0.1:%d" % up.port


def test_an_absolute_form_target_on_the_llm_path_goes_upstream_in_origin_form(edge):
    port, up, _ = edge()
    data = exchange(port, b"POST http://evil.example/v1/chat/completions HTTP/1.1\r\nHost: evil.example\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                    % (len(CHAT), CHAT))
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    (line, headers, body), = up.requests
    assert line == b"POST /v1/chat/completions HTTP/1.1" and headers[b"host"] == b"127.0.0.1:%d" % up.port
    assert body == CHAT


@pytest.mark.parametrize("request_line,status", [
    (b"GET evil.example:443 HTTP/1.1", 400),  # authority form
    (b"CONNECT evil.example:443 HTTP/1.1", 405),
    (b"OPTIONS * HTTP/1.1", 400),  # asterisk form
])
def test_targets_that_are_not_paths_are_refused_and_never_relayed(edge, request_line, status):
    port, up, _ = edge()
    data = exchange(port, request_line + b"\r\nHost: evil.example\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 %d " % status), data[:200]
    assert b"connection: close" in data.lower()
    time.sleep(0.1)
    assert up.requests == [] and up.connections == 0


# -- transfer codings ------------------------------------------------------------------------------
@pytest.mark.parametrize("codings", [
    [b"gzip, chunked"], [b"chunked, identity"], [b"identity"], [b"gzip", b"chunked"], [b"chunked", b"chunked"],
    [b"Chunked "],  # exactly chunked (case and spaces do not matter): accepted
])
def test_any_transfer_coding_but_chunked_is_refused(edge, codings):
    port, up, _ = edge()
    te = b"".join(b"Transfer-Encoding: %s\r\n" % c for c in codings)
    data = exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
                          + te + b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT))
    if codings == [b"Chunked "]:
        assert data.startswith(b"HTTP/1.1 200 ") and [r[2] for r in up.requests] == [CHAT]
        return
    assert data.startswith((b"HTTP/1.1 501 ", b"HTTP/1.1 400 ")), data[:200]
    assert up.requests == []


def test_gzip_chunked_gets_501_not_a_relay_of_the_still_encoded_body(edge):
    port, up, core = edge()
    data = exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n"
                          b"\r\n3\r\nabc\r\n0\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 501 Not Implemented\r\n") and b'"error"' in data
    assert up.requests == []
    assert core.stats()["proxy"]["requests_refused"] == 1


# -- slow clients ------------------------------------------------------------------------------------
def test_a_head_sent_one_byte_at_a_time_is_cut_at_the_head_deadline(edge):
    port, up, _ = edge(head_timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = b"GET /v1/models HTTP/1.1\r\nHost: h\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    t0 = time.monotonic()
    got = b""
    try:
        for b in head:
            s.sendall(bytes([b]))  # a byte every 50 ms: each one used to refresh the idle timer
            time.sleep(0.05)
            r, _, _ = select.select([s], [], [], 0)
            if r:
                got = s.recv(65536)
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    elapsed = time.monotonic() - t0
    s.close()
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert 1.0 <= elapsed < 4.0, elapsed  # the deadline (1 s) plus at most one sweep period
    assert up.requests == []


def test_a_stalled_body_is_cut_at_the_body_deadline(edge):
    port, up, _ = edge(body_timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 100\r\n\r\n{\"model\":")
    t0 = time.monotonic()
    s.settimeout(10)
    try:
        data = s.recv(65536)
    except ConnectionResetError:
        data = b""
    elapsed = time.monotonic() - t0
    s.close()
    assert data in (b"",) or data.startswith(b"HTTP/1.1 408 ")
    assert 1.0 <= elapsed < 4.0, elapsed
    assert up.requests == []


def test_a_slow_but_steady_body_and_a_quick_head_are_not_cut(edge):
    port, up, _ = edge(head_timeout_s=1.0, body_timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(CHAT))
    for i in range(0, len(CHAT), 10):  # 2.5 s in all, never silent for 1 s
        s.sendall(CHAT[i:i + 10])
        time.sleep(0.4)
    s.settimeout(10)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    assert data.startswith(b"HTTP/1.1 200 ") and [r[2] for r in up.requests] == [CHAT]


# -- connection cap ----------------------------------------------------------------------------------
def test_past_the_connection_cap_the_longest_idle_connection_makes_room(edge):
    port, up, core = edge(max_client_connections=4)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
    time.sleep(0.2)
    with httpx.Client(timeout=10) as c:  # a well-formed client is served all the same
        for _ in range(3):
            assert c.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
    closed = 0
    for s in idle:
        s.settimeout(2)
        try:
            closed += s.recv(1) == b""
        except ConnectionResetError:
            closed += 1
        except socket.timeout:
            pass
        s.close()
    assert closed == 1  # the oldest idle one, once; the client's connection is kept alive
    assert core.stats()["proxy"]["connections_evicted"] == 1


def test_past_the_connection_cap_with_every_connection_busy_the_answer_is_503_retry(edge):
    port, up, core = edge(lambda n, k: "answer", max_client_connections=2)
    # two requests in flight: their heads are in, their bodies never finish
    busy = []
    for _ in range(2):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 50\r\n\r\n{")
        busy.append(s)
    time.sleep(0.3)
    data = exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: h\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 503 "), data[:200]
    assert b"x-should-retry: true" in data.lower() and b"connection: close" in data.lower()
    for s in busy:
        s.close()
    time.sleep(0.3)
    with httpx.Client(timeout=10) as c:  # once they are gone, clients are served again
        assert c.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
    assert up.requests and all(line.startswith(b"GET /v1/models") for line, _, _ in up.requests)


# -- retries to the primary --------------------------------------------------------------------------
def _post(port: int) -> httpx.Response:
    with httpx.Client(timeout=10) as c:
        return c.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=CHAT,
                      headers={"Content-Type": "application/json"})


def test_a_request_the_primary_read_is_never_sent_twice(edge):
    # the second request on the kept-alive connection is read whole, then the connection closes
    # without an answer (as a primary that crashed mid-generation): it must not be resent
    port, up, _ = edge(lambda n, k: "close" if n == 2 else "answer")
    assert _post(port).status_code == 200
    r = _post(port)
    assert r.status_code == 502 and r.headers["x-should-retry"] == "true"
    time.sleep(0.2)
    assert len(up.requests) == 2  # the primary saw it once


def test_a_request_reset_unread_on_a_reused_connection_is_sent_once_more(edge):
    # the kept-alive connection is closed with the second request unread (the kernel resets it):
    # the primary never saw it, so it goes out again on a new connection
    port, up, _ = edge(lambda n, k: "reset-unread" if k == 1 else "answer")
    assert _post(port).status_code == 200
    r = _post(port)
    assert r.status_code == 200 and r.json()["id"] == "x"
    assert len(up.requests) == 2 and up.connections == 2


def test_an_upgrade_request_with_a_body_is_refused_not_relayed_without_its_body(edge):
    # httptools has llhttp skip the body of a request that asks to upgrade (Connection: Upgrade,
    # Upgrade: h2c, as curl --http2 sends): relayed, the primary got the request with an empty body
    port, up, _ = edge()
    data = exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
                          b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT))
    assert data.startswith(b"HTTP/1.1 501 "), data[:200]
    assert up.requests == []


def test_an_upgrade_request_without_a_body_is_relayed_as_a_plain_request(edge):
    port, up, _ = edge()
    data = exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 200 ")
    (line, headers, _), = up.requests
    assert line == b"GET /v1/models HTTP/1.1" and b"upgrade" not in headers


@pytest.mark.parametrize("request_bytes", [b"GET /v1/models\r\n\r\n",  # HTTP/0.9: no version
                                           b"GET /v1/models HTTP/2.0\r\nHost: h\r\n\r\n"])
def test_http_versions_other_than_1x_are_refused(edge, request_bytes):
    port, up, _ = edge()
    data = exchange(port, request_bytes)
    assert data.startswith(b"HTTP/1.1 505 "), data[:200]
    assert up.requests == []
