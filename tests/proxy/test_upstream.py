"""The lean upstream client (tensorverse.proxy.upstream) against raw upstreams that misbehave in
ways the fake does not: closing kept-alive connections, silences, answers that are not HTTP,
interim responses, bodies delimited by the end of the connection."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tensorverse.proxy.core import ProxyCore

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
OK = b'{"id":"x","object":"chat.completion","choices":[]}'


class RawUpstream:
    """An asyncio server that answers each request with ``script(n)`` (n: requests so far on
    all connections): (bytes to send, then close the connection?, seconds to wait first)."""

    def __init__(self, script):
        self.script = script
        self.requests = 0
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> "RawUpstream":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                self.requests += 1
                data, close, wait = self.script(self.requests)
                if wait:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                if close:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5)


def _response(body: bytes = OK, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
            + extra + b"\r\n" + body)


@pytest.fixture
def raws(loop):
    made: list[RawUpstream] = []
    yield made
    for up in made:
        loop.run(up.close())


@pytest.fixture
def core(loop, raws):
    made = []

    def make(upstream: RawUpstream, **kw) -> str:
        raws.append(upstream)
        c = ProxyCore(f"http://127.0.0.1:{upstream.port}", **kw)
        port = loop.run(c.start())
        made.append(c)
        return f"http://127.0.0.1:{port}"

    yield make
    for c in made:
        loop.run(c.close())


def _raw(loop, script) -> RawUpstream:
    return loop.run(RawUpstream(script).start())


def test_connections_are_kept_alive_and_reused(loop, core):
    up = _raw(loop, lambda n: (_response(), False, 0))
    url = core(up)
    with httpx.Client(timeout=10) as c:
        for _ in range(5):
            assert c.post(url + "/v1/chat/completions", json=BODY).json()["id"] == "x"
    assert up.requests == 5 and up.connections == 1


def test_kept_alive_connection_closed_by_upstream_is_replaced(loop, core):
    # the upstream closes each connection right after its answer (as uvicorn does once its
    # keep-alive timeout passes): the next request goes out on a new connection, unharmed
    up = _raw(loop, lambda n: (_response(), True, 0))
    url = core(up)
    with httpx.Client(timeout=10) as c:
        for _ in range(4):
            r = c.post(url + "/v1/chat/completions", json=BODY)
            assert r.status_code == 200 and r.json()["id"] == "x"
    assert up.requests == 4 and up.connections == 4


def test_upstream_closing_without_answer_gives_502(loop, core):
    up = _raw(loop, lambda n: (b"", True, 0))
    url = core(up)
    with httpx.Client(timeout=10) as c:
        r = c.post(url + "/v1/chat/completions", json=BODY)
    assert r.status_code == 502 and r.headers["x-should-retry"] == "true"
    assert "closed the connection" in r.json()["error"]["message"]


def test_not_http_gives_502(loop, core):
    up = _raw(loop, lambda n: (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", False, 0))
    url = core(up)
    with httpx.Client(timeout=10) as c:
        r = c.post(url + "/v1/chat/completions", json=BODY)
    assert r.status_code == 502 and "invalid HTTP response" in r.json()["error"]["message"]


def test_read_timeout_gives_504(loop, core):
    up = _raw(loop, lambda n: (_response(), False, 2.0))
    url = core(up, read_timeout_s=0.3)
    with httpx.Client(timeout=10) as c:
        r = c.post(url + "/v1/chat/completions", json=BODY)
    assert r.status_code == 504


def test_interim_response_and_body_until_close(loop, core):
    body = json.dumps({"id": "y", "choices": []}).encode()
    up = _raw(loop, lambda n: (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                               b"Connection: close\r\n\r\n" + body, True, 0))
    url = core(up)
    with httpx.Client(timeout=10) as c:
        r = c.post(url + "/v1/chat/completions", json=BODY)
    assert r.status_code == 200 and r.json() == {"id": "y", "choices": []}


def test_cut_mid_body_is_an_incomplete_response(loop, core):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    up = _raw(loop, lambda n: (head + b"10\r\ndata: {\"a\": 1}\n\n\r\n", True, 0))  # no last chunk
    url = core(up)
    with httpx.Client(timeout=10) as c:
        with pytest.raises(httpx.HTTPError):
            with c.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True}) as r:
                for _ in r.iter_bytes():
                    pass
