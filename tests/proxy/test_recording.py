"""Recording and sessions against the fake vLLM upstream."""

from __future__ import annotations

import httpx
import openai
import pytest

TOOLS = [{"type": "function", "function": {"name": "get_interface_0", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]


def test_stream_turn_record(fake, make_proxy, settle, turns):
    proxy = make_proxy(fake.url, sessions={"tags": {"agent": "netops", "env": "test"}})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-secret", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Fake-Tools": "2", "X-Fake-Reasoning": "1", "X-Fake-Delay": "0.01",
                       "Cookie": "sid=abc"}))
    assert chunks[-1].usage.completion_tokens == 8
    settle(proxy)
    [t] = turns(proxy)
    assert t.state == "ok" and t.status == 200 and t.stream is True and t.endpoint == "chat.completions"
    assert t.prompt_token_ids == [151644, 872, 198, 6023, 151645]
    assert t.output_token_ids == [999, 1000, 1001, 1002, 1003]
    assert t.reasoning == "thinking..."
    assert t.tool_calls == [
        {"id": "chatcmpl-tool-0", "type": "function", "function": {"name": "get_interface_0", "arguments": '{"name":"Gi0/0/0"}'}},
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_interface_1", "arguments": '{"name":"Gi0/0/1"}'}},
    ]
    assert t.finish_reason == "tool_calls"
    assert t.usage["completion_tokens"] == 8
    assert t.tools_offered is True
    assert len(t.choices[0]["logprobs"]) == 4 and t.choices[0]["logprobs"][0]["token"] == 1000
    assert t.injected == {"return_token_ids": True, "logprobs": True, "top_logprobs": 5,
                             "return_tokens_as_token_ids": True}
    tm = t.timings
    assert 0 < tm["ttfb_ms"] <= tm["ttft_ms"] <= tm["total_ms"]
    headers = {k.lower() for k in t.request_headers}
    assert "authorization" not in headers and "cookie" not in headers
    assert "sk-secret" not in repr(t) and "sid=abc" not in repr(t)
    assert t.request["messages"] == [{"role": "user", "content": "hi"}]
    [s] = list(proxy.store.iter_sessions())
    assert s.tags == {"agent": "netops", "env": "test"} and s.turns == 1


def test_nonstream_turn_record(fake, make_proxy, settle, turns):
    proxy = make_proxy(fake.url)
    with httpx.Client(timeout=30) as c:
        c.post(proxy.url + "/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": 8},
               headers={"Authorization": "Bearer sk-x", "X-Api-Key": "k2"})
    settle(proxy)
    [t] = turns(proxy)
    assert t.endpoint == "completions" and t.state == "ok"
    assert t.prompt_token_ids == [151644, 872, 198, 6023, 151645]
    assert t.output_token_ids == [1000 + i for i in range(8)]
    assert t.text == "t0 t1 t2 t3 t4 t5 t6 t7 " and t.finish_reason == "length"
    assert t.timings["ttft_ms"] == t.timings["total_ms"]
    assert "sk-x" not in repr(t) and "k2" not in repr(t)


def _agent_loop(client, first_user, turns_n, extra_headers=None):
    msgs = [{"role": "system", "content": "You are a network agent."}, {"role": "user", "content": first_user}]
    for k in range(turns_n):
        r = client.chat.completions.create(model="fake", messages=msgs, tools=TOOLS,
                                           extra_headers={"X-Fake-Tools": "1" if k < turns_n - 1 else "0",
                                                          **(extra_headers or {})})
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))  # as agent frameworks resend it
        for tc in m.tool_calls or ():
            msgs.append({"role": "tool", "tool_call_id": tc.id, "content": "up, 1 Gbit/s"})
        if not m.tool_calls:
            msgs.append({"role": "user", "content": "thanks, next"})
    return msgs


def test_multi_turn_tool_session_grouped_by_prefix(fake, make_proxy, settle, turns):
    proxy = make_proxy(fake.url)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
    _agent_loop(client, "check Gi0/0/0", 4)
    _agent_loop(client, "check Gi0/0/9", 3)  # another conversation: another session
    settle(proxy)
    sessions = list(proxy.store.iter_sessions())
    assert len(sessions) == 2
    by_session = {s.id: [t.index for t in proxy.store.iter_turns(s.id)] for s in sessions}
    assert sorted(by_session.values()) == [[0, 1, 2], [0, 1, 2, 3]]
    assert proxy.sessions.stats()["by_prefix"] == 5


def test_resent_history_variants_still_match(fake, make_proxy, settle):
    """Agents resend assistant messages with content "" vs null, list parts, other ids."""
    proxy = make_proxy(fake.url)
    with httpx.Client(timeout=30) as c:
        msgs = [{"role": "user", "content": "go"}]
        r = c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": msgs},
                   headers={"X-Fake-Tools": "1"}).json()
        call = r["choices"][0]["message"]["tool_calls"][0]
        resent = {"role": "assistant", "content": "",
                  "tool_calls": [{"id": "other-id", "type": "function",
                                  "function": {"name": call["function"]["name"],
                                               "arguments": '{ "name" : "Gi0/0/0" }'}}]}
        msgs += [resent, {"role": "tool", "tool_call_id": "other-id", "content": [{"type": "text", "text": "ok"}]}]
        c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": msgs})
    settle(proxy)
    assert len(list(proxy.store.iter_sessions())) == 1


def test_header_session_and_tags(fake, make_proxy, settle, turns):
    proxy = make_proxy(fake.url, sessions={"tags": {"agent": "a1"}})
    with httpx.Client(timeout=30) as c:
        for i in range(3):
            c.post(proxy.url + "/v1/chat/completions",
                   json={"model": "fake", "messages": [{"role": "user", "content": f"unrelated {i}"}]},
                   headers={"X-Tensorverse-Session": "ticket-42", "X-Tensorverse-Tags": "env=prod, run=7"})
    settle(proxy)
    [s] = list(proxy.store.iter_sessions())
    assert s.id == "ticket-42" and s.tags == {"agent": "a1", "env": "prod", "run": "7"}
    assert [t.index for t in turns(proxy)] == [0, 1, 2]
    # the header never reaches the upstream
    assert all("X-Tensorverse-Session" not in r["headers"] for r in fake.requests)


def test_anthropic_messages_recorded_and_grouped(fake, make_proxy, settle, turns):
    import anthropic
    proxy = make_proxy(fake.url)
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0)
    direct = anthropic.Anthropic(base_url=fake.url, api_key="sk-ant", max_retries=0)
    tools = [{"name": "get_interface_0", "input_schema": {"type": "object", "properties": {"name": {"type": "string"}}}}]
    msgs = [{"role": "user", "content": "check"}]
    a = client.messages.create(model="fake", max_tokens=16, messages=msgs, tools=tools, extra_headers={"X-Fake-Tools": "1"})
    b = direct.messages.create(model="fake", max_tokens=16, messages=msgs, tools=tools, extra_headers={"X-Fake-Tools": "1"})
    assert a.model_dump() == b.model_dump()
    msgs += [{"role": "assistant", "content": [blk.model_dump() for blk in a.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "up"}]}]
    with client.messages.stream(model="fake", max_tokens=16, messages=msgs, tools=tools,
                                extra_headers={"X-Fake-Tools": "1"}) as s:
        final = s.get_final_message()
    assert final.content[1].input == {"name": "Gi0/0/0"}
    settle(proxy)
    ts = turns(proxy)
    assert [t.index for t in ts] == [0, 1] and len(list(proxy.store.iter_sessions())) == 1
    assert ts[1].tool_calls[0]["function"] == {"name": "get_interface_0", "arguments": '{"name":"Gi0/0/0"}'}
    assert ts[1].finish_reason == "tool_use" and ts[1].text == "t0 t1 t2 t3 "
    assert "sk-ant" not in repr(ts)


def test_store_full_keeps_proxying(fake, make_proxy, loop, settle):
    proxy = make_proxy(fake.url)

    class Full:
        def put_session(self, s):
            from tensorverse.store import StoreFullError

            raise StoreFullError("full")

        put_turn = put_session

    proxy.sessions.store = proxy.recorder.store = Full()
    with httpx.Client(timeout=30) as c:
        for _ in range(3):
            assert c.post(proxy.url + "/v1/chat/completions",
                          json={"model": "fake", "messages": [{"role": "user", "content": "x"}]}).status_code == 200
    settle(proxy)
    assert proxy.recorder.counters["store_full"] == 3


def test_recording_disabled_is_a_plain_relay(fake, make_proxy):
    proxy = make_proxy(fake.url, recording={"enabled": False})
    with httpx.Client(timeout=30) as c:
        c.post(proxy.url + "/v1/chat/completions", json={"model": "fake", "messages": []})
    assert b"return_token_ids" not in fake.requests[-1]["body"]


def test_client_that_closes_at_the_last_event_gets_a_complete_turn(fake, make_proxy, settle, turns):
    """The openai client closes its connection as soon as it has ``data: [DONE]``; the proxy may
    still be writing the stream's end. Those turns are complete: recorded ``ok`` with every token,
    never lost and never ``aborted`` (a raw socket closes right after [DONE], many times over)."""
    import socket

    proxy = make_proxy(fake.url)
    port = int(proxy.url.rsplit(":", 1)[1])
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    n = 20
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"X-Fake-Events: 6\r\nX-Fake-Linger: 0.05\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while b"data: [DONE]" not in got:
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
    settle(proxy)
    ts = turns(proxy)
    assert len(ts) == n
    assert {t.state for t in ts} == {"ok"}
    assert all(len(t.output_token_ids) == 6 for t in ts)


def test_mid_stream_error_event_makes_an_upstream_error_turn(fake, make_proxy, settle, turns):
    """vLLM reports an engine failure inside a 200 stream (``data: {"error": ...}`` then
    ``[DONE]``): the client gets it as it is, and the turn is an upstream error with partial
    output, not an ``ok`` turn to shadow."""
    proxy = make_proxy(fake.url)
    r = httpx.post(proxy.url + "/v1/chat/completions", headers={"X-Fake-Error-Event": "3"}, timeout=10,
                   json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "fake engine failure mid-stream" in r.text
    settle(proxy)
    (t,) = turns(proxy)
    assert t.state == "upstream_error" and "fake engine failure mid-stream" in t.error
    assert t.status == 200


@pytest.mark.parametrize("depth", [300, 1015])
def test_request_nested_deeper_than_orjson_writes_is_injected_relayed_and_recorded(fake, make_proxy, settle, turns,
                                                                                  depth):
    """orjson reads 1,024 levels of nesting but writes only 254: a request nested deeper, up to
    what orjson reads, must still be injected, relayed, grouped and recorded, with no addon error
    (1015 + the body's own 3 levels: the standard library's writer needs room on the stack)."""
    proxy = make_proxy(fake.url)
    body = (b'{"model":"m","messages":[{"role":"user","content":"hi","extra":' + b"[" * depth + b'"x"'
            + b"]" * depth + b"}]}")
    r = httpx.post(proxy.url + "/v1/chat/completions", content=body, timeout=10,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    settle(proxy)
    (t,) = turns(proxy)
    assert t.state == "ok" and t.session_id
    extra, levels = t.request["messages"][0]["extra"], 0
    while isinstance(extra, list):  # not ==: comparing 1,015 levels recurses past Python's limit
        extra, levels = extra[0], levels + 1
    assert (levels, extra) == (depth, "x")
    assert t.injected  # the injector re-serialised it
    assert proxy.stats()["proxy"]["addon_errors"] == 0
