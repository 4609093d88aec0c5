"""The core's addon hooks: their order, each once per LLM flow, and `request_forwarded` running
while the upstream already has the request (so work there, such as session grouping, does not
delay it)."""

from __future__ import annotations

import socket
import threading
import time

import httpx

from tensorverse.proxy.core import ProxyCore
from tensorverse.proxy.flow import Addon, Flow
from tensorverse.ports import free_port


class Trace(Addon):
    name = "trace"

    def __init__(self, block_s: float = 0.0) -> None:
        self.calls: list[tuple[str, str]] = []
        self.block_s = block_s
        self.forwarded_at: list[tuple[float, float]] = []

    async def request(self, flow: Flow) -> None:
        self.calls.append(("request", flow.id))

    def request_forwarded(self, flow: Flow) -> None:
        t = time.perf_counter()
        time.sleep(self.block_s)  # blocks the proxy's loop, as heavy hook work would
        self.forwarded_at.append((t, time.perf_counter()))
        self.calls.append(("request_forwarded", flow.id))

    def response_start(self, flow: Flow) -> None:
        self.calls.append(("response_start", flow.id))

    async def response_done(self, flow: Flow) -> None:
        self.calls.append(("response_done", flow.id))

    async def error(self, flow: Flow) -> None:
        self.calls.append(("error", flow.id))


class ThreadUpstream:
    """A one-answer-per-connection HTTP upstream in its own thread (not on the proxy's loop), which
    notes when each request arrived."""

    BODY = b'{"id":"x","object":"chat.completion","choices":[]}'

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.arrived: list[float] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                self.arrived.append(time.perf_counter())
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n")
                                   if ln.lower().startswith(b"content-length")), b"0"))
                while len(rest) < length:  # all of it: unread bytes would make the close a reset
                    rest += conn.recv(65536)
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        time.sleep(0.05)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(self.BODY), self.BODY))

    def close(self) -> None:
        self.sock.close()


def _core(loop, upstream: str, trace: Trace) -> ProxyCore:
    core = ProxyCore(upstream, [trace])
    loop.run(core.start())
    return core


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_hooks_in_order_once_each(fake, loop):
    trace = Trace()
    core = _core(loop, fake.url, trace)
    try:
        with httpx.Client(timeout=30) as c:
            assert c.post(f"http://127.0.0.1:{core.port}/v1/chat/completions", json={**CHAT, "stream": True}).status_code == 200
            assert c.get(f"http://127.0.0.1:{core.port}/v1/models").status_code == 200  # not an LLM turn: no hooks
        loop.run(core.drain(5))
        assert [name for name, _ in trace.calls] == ["request", "request_forwarded", "response_start", "response_done"]
        assert len({fid for _, fid in trace.calls}) == 1
    finally:
        loop.run(core.close())


def test_forwarded_runs_once_when_the_upstream_is_down(loop):
    port = free_port()  # nothing listens there
    trace = Trace()
    core = _core(loop, f"http://127.0.0.1:{port}", trace)
    try:
        with httpx.Client(timeout=30) as c:
            assert c.post(f"http://127.0.0.1:{core.port}/v1/chat/completions", json=CHAT).status_code == 502
        loop.run(core.drain(5))
        assert [name for name, _ in trace.calls] == ["request", "request_forwarded", "error"]
    finally:
        loop.run(core.close())


def test_forwarded_work_does_not_delay_the_upstream_request(loop):
    up = ThreadUpstream()
    trace = Trace(block_s=0.3)
    core = _core(loop, f"http://127.0.0.1:{up.port}", trace)
    try:
        with httpx.Client(timeout=30) as c:
            assert c.post(f"http://127.0.0.1:{core.port}/v1/chat/completions", json=CHAT).status_code == 200
        (_started, ended), = trace.forwarded_at
        arrived, = up.arrived
        assert arrived < ended - 0.2  # the upstream had the request while the hook was still busy
    finally:
        loop.run(core.close())
        up.close()


class Runs(Addon):
    """Notes each run of events the relay hands to the rewriters."""

    name = "runs"

    def __init__(self) -> None:
        self.runs: list[bytes] = []

    def stream_rewrite(self, flow: Flow, data: bytes) -> bytes:
        self.runs.append(data)
        return data


class BurstUpstream(ThreadUpstream):
    """Answers a stream whose events all arrive in one read (as a fast upstream's often do)."""

    EVENTS = [b'data: {"choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]

    def _answer(self, conn: socket.socket) -> None:
        body = b"".join(self.EVENTS)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))


def test_first_event_goes_out_alone(loop):
    """The events read with the first one are rewritten after the first is on its way: the
    client's first token does not wait for them."""
    up = BurstUpstream()
    runs = Runs()
    core = ProxyCore(f"http://127.0.0.1:{up.port}", [runs])
    loop.run(core.start())
    try:
        with httpx.Client(timeout=30) as c:
            r = c.post(f"http://127.0.0.1:{core.port}/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200 and r.content == b"".join(BurstUpstream.EVENTS)
        assert runs.runs == [BurstUpstream.EVENTS[0], b"".join(BurstUpstream.EVENTS[1:])]
    finally:
        loop.run(core.close())
        up.close()
