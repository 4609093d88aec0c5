"""The proxy core against the fake vLLM upstream: relaying, streaming, errors, limits."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import orjson
import pytest

from tensorverse.testing.fake_upstream import FakeUpstream
from tensorverse.ports import free_port


def _direct_vs_proxy(fake, proxy, path, body, headers=None):
    with httpx.Client(timeout=30) as c:
        d = c.post(fake.url + path, json=body, headers=headers or {})
        p = c.post(proxy.url + path, json=body, headers=headers or {})
    return d, p


def test_nonstream_body_identical_to_direct_call(fake, make_proxy, loop):
    proxy = make_proxy(fake.url)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    d, p = _direct_vs_proxy(fake, proxy, "/v1/chat/completions", body)
    assert p.status_code == d.status_code == 200
    dj, pj = d.json(), p.json()
    for j in (dj, pj):
        j.pop("id")
    assert pj == dj  # injected token ids and logprobs are put back to null
    # ... while the upstream did receive the injection
    sent = orjson.loads(fake.requests[-1]["body"])
    assert sent["return_token_ids"] is True and sent["logprobs"] is True and sent["top_logprobs"] == 5
    assert sent["messages"] == body["messages"]


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stream_events_identical_to_direct_call(fake, make_proxy, kind):
    proxy = make_proxy(fake.url)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {"model": "fake", "stream": True, "max_tokens": 8}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"})

    def events(url):
        with httpx.Client(timeout=30) as c, c.stream("POST", url + path, json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            return r.headers, [e for e in r.read().split(b"\n\n") if e]

    dh, de = events(fake.url)
    ph, pe = events(proxy.url)
    assert ph["x-accel-buffering"] == "no"
    strip_id = lambda evs: [orjson.loads(e[6:]) | {"id": None} if e != b"data: [DONE]" else e for e in evs]  # noqa: E731
    assert strip_id(pe) == strip_id(de)


def test_client_logprobs_request_left_alone(fake, make_proxy):
    proxy = make_proxy(fake.url)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    d, p = _direct_vs_proxy(fake, proxy, "/v1/chat/completions", body)
    dj, pj = d.json(), p.json()
    dj.pop("id"), pj.pop("id")
    assert pj == dj
    sent = orjson.loads(fake.requests[-1]["body"])
    assert sent["top_logprobs"] == 2 and "return_tokens_as_token_ids" not in sent and sent["return_token_ids"]


def test_stream_is_relayed_event_by_event(fake, make_proxy):
    """The client sees the first event while the upstream has not sent the last one yet."""
    proxy = make_proxy(fake.url)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.Client(timeout=30) as c, c.stream(
        "POST", proxy.url + "/v1/chat/completions", json=body, headers={"X-Fake-Events": "6", "X-Fake-Delay": "0.3"}
    ) as r:
        it = r.iter_raw()
        first = next(it)
        t_first = time.monotonic()
        assert first.startswith(b"data: ")
        rest = b"".join(it)
    assert fake.last_event_sent is not None and fake.last_event_sent > t_first + 1.0
    assert rest.endswith(b"data: [DONE]\n\n")


def test_openai_client_sync_and_async_through_fake(fake, make_proxy):
    proxy = make_proxy(fake.url)
    msgs = [{"role": "user", "content": "hi"}]
    direct = openai.OpenAI(base_url=fake.url + "/v1", api_key="k", max_retries=0)
    via = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    a = direct.chat.completions.create(model="fake", messages=msgs, extra_headers={"X-Fake-Tools": "2"})
    b = via.chat.completions.create(model="fake", messages=msgs, extra_headers={"X-Fake-Tools": "2"})
    assert b.model_dump(exclude={"id"}) == a.model_dump(exclude={"id"})
    assert [t.function.name for t in b.choices[0].message.tool_calls] == ["get_interface_0", "get_interface_1"]
    sa = [c.model_dump(exclude={"id"}) for c in direct.chat.completions.create(
        model="fake", messages=msgs, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Fake-Tools": "1", "X-Fake-Reasoning": "1"})]
    sb = [c.model_dump(exclude={"id"}) for c in via.chat.completions.create(
        model="fake", messages=msgs, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Fake-Tools": "1", "X-Fake-Reasoning": "1"})]
    assert sb == sa

    import asyncio

    async def run():
        ad = openai.AsyncOpenAI(base_url=fake.url + "/v1", api_key="k", max_retries=0)
        ap = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        x = await ad.completions.create(model="fake", prompt="hi", logprobs=1)
        y = await ap.completions.create(model="fake", prompt="hi", logprobs=1)
        assert y.model_dump(exclude={"id"}) == x.model_dump(exclude={"id"})
        xs = [c.model_dump(exclude={"id"}) async for c in await ad.completions.create(model="fake", prompt="hi", stream=True)]
        ys = [c.model_dump(exclude={"id"}) async for c in await ap.completions.create(model="fake", prompt="hi", stream=True)]
        assert ys == xs
        await ad.close()
        await ap.close()

    asyncio.run(run())


@pytest.mark.parametrize("status", [400, 404, 422, 429, 500, 503])
def test_upstream_error_status_relayed(fake, make_proxy, loop, status, settle, turns):
    proxy = make_proxy(fake.url)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    d, p = _direct_vs_proxy(fake, proxy, "/v1/chat/completions", body, {"X-Fake-Status": str(status)})
    assert p.status_code == d.status_code == status
    assert p.json() == d.json()
    settle(proxy)
    [t] = turns(proxy)
    assert t.state == "upstream_error" and t.status == status
    assert "fake error" in t.response_text


def test_malformed_upstream_body_relayed(fake, make_proxy, loop, settle, turns):
    proxy = make_proxy(fake.url)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    d, p = _direct_vs_proxy(fake, proxy, "/v1/chat/completions", body, {"X-Fake-Body": '{"choices": [tru'})
    assert p.status_code == d.status_code == 200
    assert p.content == d.content == b'{"choices": [tru'
    settle(proxy)
    [t] = turns(proxy)
    assert t.response_unparsed is True and t.response_text == '{"choices": [tru'


def test_invalid_json_request_relayed_unchanged_and_recorded_unparsed(fake, make_proxy, loop, settle, turns):
    proxy = make_proxy(fake.url)
    raw = b'{"model": "fake", "messages": [ oops'
    with httpx.Client(timeout=30) as c:
        p = c.post(proxy.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert p.status_code == 400 and "JSON decode error" in p.json()["error"]["message"]
    assert fake.requests[-1]["body"] == raw
    settle(proxy)
    [t] = turns(proxy)
    assert t.request_unparsed is True and t.request_text == raw.decode()
    assert t.request is None and "invalid JSON" in t.request_parse_error


def test_upstream_down_gives_openai_shaped_502(make_proxy, loop, settle, turns):
    port = free_port()
    proxy = make_proxy(f"http://127.0.0.1:{port}")
    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": []})
        m = c.post(proxy.url + "/v1/messages", json={"model": "m", "messages": [], "max_tokens": 1})
    assert r.status_code == 502 and r.headers["x-should-retry"] == "true"
    err = r.json()["error"]
    assert err["code"] == 502 and "unreachable" in err["message"]
    assert m.status_code == 502 and m.json()["type"] == "error"  # Anthropic's shape on /v1/messages
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 502
    settle(proxy)
    states = sorted(t.state for t in turns(proxy))
    assert states == ["error"] * 3


def test_body_over_limit_gets_413(fake, make_proxy):
    proxy = make_proxy(fake.url, proxy={"max_body_bytes": 1000})
    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.url + "/v1/chat/completions", content=b"x" * 5000)
        ok = c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": []})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert ok.status_code == 200
    assert len(fake.requests) == 1  # the big body never went upstream


def test_body_over_limit_chunked(fake, make_proxy):
    proxy = make_proxy(fake.url, proxy={"max_body_bytes": 1000})

    def gen():
        for _ in range(10):
            yield b"y" * 500

    with httpx.Client(timeout=30) as c:
        r = c.post(proxy.url + "/v1/chat/completions", content=gen())
    assert r.status_code == 413


def test_hop_by_hop_headers_not_forwarded(fake, make_proxy):
    proxy = make_proxy(fake.url)
    with httpx.Client(timeout=30) as c:
        r = c.post(
            proxy.url + "/echo/x?a=1&b=%2F",
            content=b"payload",
            headers={"Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "1", "Keep-Alive": "timeout=9",
                     "TE": "trailers", "X-End-To-End": "kept", "Authorization": "Bearer secret",
                     "X-Tensorverse-Session": "s1", "Upgrade": "h2c"},
        )
    assert r.status_code == 200
    seen = {k.lower(): v for k, v in r.json()["headers"].items()}
    assert r.json()["path"] == "/echo/x?a=1&b=%2F"
    assert seen["x-end-to-end"] == "kept" and seen["authorization"] == "Bearer secret"
    for h in ("x-drop-me", "keep-alive", "te", "upgrade", "x-tensorverse-session"):
        assert h not in seen, h
    # response side: the upstream's Connection-listed header and Keep-Alive do not reach the client
    assert r.headers["x-upstream"] == "1"
    assert "x-hop" not in r.headers and "keep-alive" not in r.headers


def test_other_paths_and_methods_relayed(fake, make_proxy):
    proxy = make_proxy(fake.url)
    with httpx.Client(timeout=30) as c:
        assert c.get(proxy.url + "/v1/models").json()["data"][0]["id"] == "fake"
        assert c.get(proxy.url + "/health").status_code == 200
        assert c.get(proxy.url + "/upstream/health").status_code == 200
        for method in ("PUT", "DELETE", "PATCH"):
            r = c.request(method, proxy.url + "/echo/m", content=b"abc")
            assert r.json()["method"] == method and r.json()["body"] == "abc"
        assert c.get(proxy.url + "/nope").status_code == 404


def test_client_disconnect_cancels_upstream_and_marks_aborted(fake, make_proxy, loop, settle, turns):
    proxy = make_proxy(fake.url)
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", proxy.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"X-Fake-Events: 100\r\nX-Fake-Delay: 0.2\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"data: " not in got:
        got += s.recv(65536)
    time.sleep(0.3)
    t_close = time.monotonic()
    s.close()
    deadline = time.monotonic() + 5
    while not fake.disconnects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.disconnects, "upstream never saw the disconnect"
    assert fake.disconnects[0] - t_close < 1.0
    settle(proxy)
    [t] = turns(proxy)
    assert t.state == "aborted"
    assert proxy.stats()["proxy"]["aborted"] == 1


def test_client_disconnect_while_waiting_for_headers(fake, make_proxy, loop, settle, turns):
    proxy = make_proxy(fake.url)
    body = json.dumps({"model": "fake", "messages": [], "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", proxy.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"X-Fake-Hang: 30\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 5
    while not fake.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close()
    deadline = time.monotonic() + 5
    while proxy.stats()["proxy"]["aborted"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    settle(proxy)
    [t] = turns(proxy)
    assert t.state == "aborted"


def test_upstream_cut_mid_stream_is_not_a_clean_end(fake, make_proxy, loop, settle, turns):
    proxy = make_proxy(fake.url)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.Client(timeout=30) as c:
        with pytest.raises(httpx.HTTPError):
            with c.stream("POST", proxy.url + "/v1/chat/completions", json=body,
                          headers={"X-Fake-Events": "10", "X-Fake-Cut": "3"}) as r:
                r.read()
    settle(proxy)
    [t] = turns(proxy)
    assert t.state == "error"


def test_rejected_injection_falls_back_to_the_clients_body(make_proxy, loop, settle, turns):
    """An upstream that refuses the injected parameters still answers the agent."""

    class Strict(FakeUpstream):
        async def chat(self, request):
            raw = await request.read()
            if b"return_token_ids" in raw:
                self.requests.append({"body": raw})
                from aiohttp import web

                return web.json_response({"error": {"message": "extra fields not permitted: return_token_ids",
                                                    "type": "BadRequestError", "param": None, "code": 400}}, status=400)
            request._read_bytes = raw
            return await super().chat(request)

    strict = loop.run(Strict().start())
    try:
        proxy = make_proxy(strict.url)
        with httpx.Client(timeout=30) as c:
            r = c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": []})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] is None
            settle(proxy)
            r2 = c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": []})
            assert r2.status_code == 200
        assert proxy.stats()["proxy"]["retried_without_injection"] == 1  # injection turned off after
        settle(proxy)
        assert all(t.retried_without_injection in (True, False) for t in turns(proxy))
    finally:
        loop.run(strict.close())


def test_concurrent_streams(fake, make_proxy, loop, settle, turns):
    proxy = make_proxy(fake.url)
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    errors = []

    def one():
        try:
            with httpx.Client(timeout=30) as c:
                r = c.post(proxy.url + "/v1/chat/completions", json=body, headers={"X-Fake-Delay": "0.01"})
                assert r.text.endswith("data: [DONE]\n\n")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=one) for _ in range(30)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    settle(proxy)
    assert len(turns(proxy)) == 30


class _CountingUpstream:
    """A keep-alive HTTP/1.1 upstream that answers every request with a small JSON body and counts
    the TCP connections it accepted (a connection the client reuses is counted once)."""

    BODY = b'{"object": "list", "data": []}'

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                _, buf = buf.split(b"\r\n\r\n", 1)  # GET: no body
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(self.BODY), self.BODY))

    def close(self) -> None:
        self.sock.close()


def test_idle_upstream_connections_are_closed_by_the_proxy_before_vllm_closes_them(make_proxy, monkeypatch):
    """vLLM's server closes a keep-alive connection idle for 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``);
    a client that reuses one at that moment writes its request into a closing socket and gets an
    error. So the proxy closes idle upstream connections first, on the paths aiohttp's client
    relays (here `/v1/models`) as on the LLM paths: a request after the keep-alive opens a new
    connection. (aiohttp's client had its own 30 s.)"""
    from tensorverse.proxy import upstream

    assert upstream.UPSTREAM_KEEPALIVE_S < 5
    monkeypatch.setattr(upstream, "UPSTREAM_KEEPALIVE_S", 0.3)  # read when the proxy starts
    up = _CountingUpstream()
    try:
        proxy = make_proxy(up.url)
        with httpx.Client(timeout=10) as c:
            assert c.get(proxy.url + "/v1/models").json() == {"object": "list", "data": []}
            assert c.get(proxy.url + "/v1/models").status_code == 200
            assert up.connections == 1  # back to back: the pooled connection is reused
            time.sleep(1.0)  # past the keep-alive (aiohttp closes idle connections on a timer)
            assert c.get(proxy.url + "/v1/models").status_code == 200
        assert up.connections == 2
    finally:
        up.close()
