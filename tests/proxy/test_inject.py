"""Injection and stripping (`tensorverse.proxy.inject`): the primary is asked for what recording
needs, and the client never sees it.

`Injector.plan` adds ``return_token_ids`` and ``logprobs``/``top_logprobs`` (with
``return_tokens_as_token_ids``) to chat and completions requests only where the client asked for
none of them; `request` writes the upstream body. What was injected is put back as ``null``, the
way vLLM writes it for a request without it: in a whole response body (`response_body`, only for
an injected request that succeeded) and in every streamed event (`stream_rewrite`), on the fast
path that cuts the values out of vLLM's own chat event bytes (`splice_chat_run`, with each of its
refusals) and on the general path, event by event (`strip_stream`, LF and CRLF), for chat and
completions alike; the parsed events are kept for the recorder. An upstream that rejects the
injected request while the client's own works makes the injector stop injecting
(`response_done`). The helpers are checked one by one.

Each test states the exact request body or response fields after injection or stripping, with
the expected values written out here (not computed by the code under test)."""

from __future__ import annotations

import asyncio
import logging

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from tensorverse.proxy import inject as inj_mod
from tensorverse.proxy.events import decode_chat_run
from tensorverse.proxy.flow import Flow
from tensorverse.proxy.inject import (
    Injector,
    _null,
    _strip_targets,
    _stripped_event,
    splice_chat_run,
    strip_response,
    strip_run,
    strip_stream,
    stripped_json,
)

CHAT = "chat.completions"
COMPL = "completions"
BOTH = {"token_ids": True, "logprobs": "drop"}
IDS = {"token_ids": True}
LP = {"logprobs": "drop"}


def _flow(body: dict | bytes, kind: str | None = CHAT) -> Flow:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return Flow("POST", "/v1/chat/completions", "", CIMultiDictProxy(CIMultiDict()), raw, kind=kind)


# -- Injector: construction, stats, plan -----------------------------------------------------------


def test_defaults_and_stats():
    i = Injector()
    assert i.return_token_ids is True
    assert i.top_logprobs == 5
    assert i.counters == {"injected": 0, "stripped_events": 0, "rejected": 0}
    assert i.stats() == {"injected": 0, "stripped_events": 0, "rejected": 0,
                         "return_token_ids": True, "top_logprobs": 5}
    j = Injector(return_token_ids=False, top_logprobs=3)
    assert j.stats() == {"injected": 0, "stripped_events": 0, "rejected": 0,
                         "return_token_ids": False, "top_logprobs": 3}
    assert Injector.name == "inject"


def test_plan_chat_every_branch():
    i = Injector()
    full = {"return_token_ids": True, "logprobs": True, "top_logprobs": 5, "return_tokens_as_token_ids": True}
    assert i.plan(CHAT, {"messages": []}) == (full, {"token_ids": True, "logprobs": "drop"})
    # The default k is 5, k = 1 is still injected (k > 0), k = 0 is not.
    assert Injector(top_logprobs=1).plan(CHAT, {})[0] == {**full, "top_logprobs": 1}
    assert Injector(top_logprobs=0).plan(CHAT, {}) == ({"return_token_ids": True}, {"token_ids": True})
    assert Injector(top_logprobs=-1).plan(CHAT, {}) == ({"return_token_ids": True}, {"token_ids": True})
    # No token ids when off, or when the client asked for them itself (any truthy value).
    no_ids = {"logprobs": True, "top_logprobs": 5, "return_tokens_as_token_ids": True}
    assert Injector(return_token_ids=False).plan(CHAT, {}) == (no_ids, {"logprobs": "drop"})
    assert i.plan(CHAT, {"return_token_ids": True}) == (no_ids, {"logprobs": "drop"})
    assert i.plan(CHAT, {"return_token_ids": 1}) == (no_ids, {"logprobs": "drop"})
    assert i.plan(CHAT, {"return_token_ids": False}) == (full, {"token_ids": True, "logprobs": "drop"})
    # The client's own logprobs: left alone, and no return_tokens_as_token_ids.
    ids_only = ({"return_token_ids": True}, {"token_ids": True})
    assert i.plan(CHAT, {"logprobs": True}) == ids_only
    assert i.plan(CHAT, {"logprobs": False, "top_logprobs": 0}) == ids_only
    assert i.plan(CHAT, {"top_logprobs": 2}) == ids_only
    assert i.plan(CHAT, {"logprobs": False}) == (full, {"token_ids": True, "logprobs": "drop"})
    assert i.plan(CHAT, {"logprobs": False, "top_logprobs": None}) == (full, BOTH)
    # Beam search and logprob_token_ids: no logprobs injected.
    assert i.plan(CHAT, {"use_beam_search": True}) == ids_only
    assert i.plan(CHAT, {"logprob_token_ids": [3]}) == ids_only
    assert i.plan(CHAT, {"use_beam_search": False, "logprob_token_ids": []}) == (full, BOTH)
    # return_tokens_as_token_ids is not added when the client set it (even to False).
    assert i.plan(CHAT, {"return_tokens_as_token_ids": False}) == (
        {"return_token_ids": True, "logprobs": True, "top_logprobs": 5}, BOTH)


def test_plan_completions_and_refusals():
    i = Injector(top_logprobs=4)
    full = {"return_token_ids": True, "logprobs": 4, "return_tokens_as_token_ids": True}
    assert i.plan(COMPL, {"prompt": "x"}) == (full, {"token_ids": True, "logprobs": "drop"})
    assert i.plan(COMPL, {"prompt": "x", "logprobs": None}) == (full, BOTH)
    # Any logprobs of the client's (0 included) is left alone; top_logprobs means nothing here.
    assert i.plan(COMPL, {"logprobs": 0}) == ({"return_token_ids": True}, {"token_ids": True})
    assert i.plan(COMPL, {"logprobs": 2}) == ({"return_token_ids": True}, {"token_ids": True})
    assert i.plan(COMPL, {"top_logprobs": 2}) == (full, BOTH)
    assert i.plan(COMPL, {"return_tokens_as_token_ids": True}) == (
        {"return_token_ids": True, "logprobs": 4}, BOTH)
    assert i.plan(COMPL, {"use_beam_search": 1}) == ({"return_token_ids": True}, {"token_ids": True})
    # Other kinds and bodies that are not objects: nothing.
    for kind, req in (("messages", {}), (None, {}), ("embeddings", {}), (CHAT, []), (CHAT, None),
                      (COMPL, "x"), (CHAT, 3)):
        assert i.plan(kind, req) == ({}, {})
    off = Injector(return_token_ids=False, top_logprobs=0)
    assert off.plan(CHAT, {}) == ({}, {})
    assert off.plan(COMPL, {}) == ({}, {})


# -- Injector: the relay hooks ---------------------------------------------------------------------


def test_request_writes_the_upstream_body():
    i = Injector()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": False}
    f = _flow(body)
    asyncio.run(i.request(f))
    assert orjson.loads(f.upstream_body) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True,
        "logprobs": True, "top_logprobs": 5, "return_tokens_as_token_ids": True}
    assert f.injected == {"return_token_ids": True, "logprobs": True, "top_logprobs": 5,
                          "return_tokens_as_token_ids": True}
    assert f.strip == {"token_ids": True, "logprobs": "drop"}
    assert i.counters == {"injected": 1, "stripped_events": 0, "rejected": 0}
    asyncio.run(i.request(_flow({"prompt": "p", "logprobs": 1}, COMPL)))
    assert i.counters["injected"] == 2


def test_request_without_anything_to_add_is_untouched():
    i = Injector()
    raw = b'{"messages": [], "return_token_ids": true, "logprobs": true}'
    f = _flow(raw)
    asyncio.run(i.request(f))
    assert f.upstream_body is raw
    assert f.injected == {}
    assert f.strip is None
    assert i.counters["injected"] == 0
    f = _flow({"messages": []}, "messages")
    asyncio.run(i.request(f))
    assert f.injected == {} and f.strip is None and i.counters["injected"] == 0


def test_response_done_stops_injecting_only_when_the_plain_request_worked(caplog):
    i = Injector()
    f = _flow({})
    f.status = 200
    asyncio.run(i.response_done(f))  # not retried: nothing
    assert i.counters["rejected"] == 0 and i.return_token_ids is True and i.top_logprobs == 5
    for status in (400, 422, 500, None):
        f = _flow({})
        f.retried_without_injection = True
        f.status = status
        asyncio.run(i.response_done(f))
        assert i.return_token_ids is True and i.top_logprobs == 5
    assert i.counters["rejected"] == 4
    f = _flow({})
    f.retried_without_injection = True
    f.status = 399
    f.strip = {"token_ids": True, "logprobs": "drop"}
    f.upstream_rejection = "x" * 299 + "YZ"
    with caplog.at_level(logging.WARNING, logger="tensorverse.proxy.inject"):
        asyncio.run(i.response_done(f))
    assert i.counters["rejected"] == 5
    assert i.return_token_ids is False and i.top_logprobs == 0
    (rec,) = [r for r in caplog.records if r.name == "tensorverse.proxy.inject"]
    assert rec.levelno == logging.WARNING
    assert rec.getMessage() == (
        "the primary rejects injected recording parameters (logprobs, token_ids); recording continues "
        "without exact token ids/logprobs. Upstream said: " + "x" * 299 + "Y")
    caplog.clear()
    j = Injector()
    f = _flow({})
    f.retried_without_injection = True
    f.status = 200
    with caplog.at_level(logging.WARNING, logger="tensorverse.proxy.inject"):
        asyncio.run(j.response_done(f))
    (rec,) = [r for r in caplog.records if r.name == "tensorverse.proxy.inject"]
    assert rec.getMessage() == (
        "the primary rejects injected recording parameters (?); recording continues "
        "without exact token ids/logprobs. Upstream said: ")
    assert j.stats()["return_token_ids"] is False and j.stats()["top_logprobs"] == 0


def _resp_flow(resp: object, *, status: int | None = 200, strip=BOTH, injected=True, kind=CHAT) -> Flow:
    f = _flow({}, kind)
    f.status = status
    if strip is not None:
        f.strip = strip
    if injected:
        f.injected = {"return_token_ids": True}
    f.response_body = orjson.dumps(resp)
    return f


def test_response_body_strips_only_injected_successful_answers():
    resp = {"id": "c", "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "message": {"content": "a"}, "token_ids": [3], "logprobs": {"content": []}}]}
    want = {"id": "c", "prompt_token_ids": None,
            "choices": [{"index": 0, "message": {"content": "a"}, "token_ids": None, "logprobs": None}]}
    for status in (200, 399):
        f = _resp_flow(resp, status=status)
        Injector().response_body(f)
        assert f.response_json == want
        assert orjson.loads(f.response_body) == want
    for kw in ({"status": 400}, {"status": 500}, {"status": None}, {"strip": None}, {"strip": {}},
               {"injected": False}):
        f = _resp_flow(resp, **kw)
        before = f.response_body
        Injector().response_body(f)
        assert f.response_body is before
        assert orjson.loads(f.response_body) == resp
    # Nothing to strip (already null) or not an object: the body is not rewritten.
    for other in ({"id": "c", "choices": [{"index": 0, "token_ids": None, "logprobs": None}]}, [1, 2], "s"):
        f = _resp_flow(other)
        before = f.response_body
        Injector().response_body(f)
        assert f.response_body is before
    # Only what was injected is stripped.
    f = _resp_flow(resp, strip={"token_ids": True})
    Injector().response_body(f)
    assert f.response_json == {"id": "c", "prompt_token_ids": None, "choices": [
        {"index": 0, "message": {"content": "a"}, "token_ids": None, "logprobs": {"content": []}}]}


CHAT_RUN = (b'data: {"id":"a","prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"content":"x"},'
            b'"logprobs":{"content":[{"token":"token_id:5","logprob":-0.1}]},"token_ids":[5]}]}\n\n'
            b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"y"},"logprobs":null,"token_ids":[6,7]}]}\n\n')
CHAT_RUN_STRIPPED = (b'data: {"id":"a","prompt_token_ids":null,"choices":[{"index":0,"delta":{"content":"x"},'
                     b'"logprobs":null,"token_ids":null}]}\n\n'
                     b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"y"},"logprobs":null,"token_ids":null}]}\n\n')


def test_stream_rewrite_counts_and_keeps_the_parsed_events():
    i = Injector()
    f = _flow({})
    f.strip = BOTH
    f.injected = {"return_token_ids": True}
    out = i.stream_rewrite(f, CHAT_RUN)
    assert out == CHAT_RUN_STRIPPED
    assert i.counters == {"injected": 0, "stripped_events": 2, "rejected": 0}
    data, parsed = f.parsed_events
    assert data is CHAT_RUN
    assert [e.id for e in parsed] == ["a", "a"]
    assert parsed[0].prompt_token_ids == [1, 2] and parsed[1].choices[0].token_ids == [6, 7]
    i.stream_rewrite(f, CHAT_RUN)
    assert i.counters["stripped_events"] == 4
    for strip, injected in ((None, True), ({}, True), (BOTH, False)):
        g = _flow({})
        if strip is not None:
            g.strip = strip
        if injected:
            g.injected = {"x": 1}
        assert i.stream_rewrite(g, CHAT_RUN) is CHAT_RUN
        assert g.parsed_events is None
    assert i.counters["stripped_events"] == 4


# -- the helpers -----------------------------------------------------------------------------------


def test_null():
    d = {"a": 1, "b": None, "c": 0, "e": False}
    assert _null(d, "a") is True
    assert _null(d, "b") is False
    assert _null(d, "c") is True  # 0 is a value, not null
    assert _null(d, "e") is True
    assert _null(d, "missing") is False
    assert d == {"a": None, "b": None, "c": None, "e": None}


def test_strip_response_exactly():
    def obj():
        return {"prompt_token_ids": [1], "choices": [
            "junk", {"index": 0, "token_ids": [2], "prompt_token_ids": [9], "logprobs": {"c": 1}},
            {"index": 1, "token_ids": None}]}
    o = obj()
    assert strip_response(COMPL, o, BOTH) is True
    assert o == {"prompt_token_ids": None, "choices": [
        "junk", {"index": 0, "token_ids": None, "prompt_token_ids": None, "logprobs": None},
        {"index": 1, "token_ids": None}]}
    o = obj()
    assert strip_response(CHAT, o, BOTH) is True  # a chat choice's prompt_token_ids is not ours
    assert o["choices"][1] == {"index": 0, "token_ids": None, "prompt_token_ids": [9], "logprobs": None}
    o = obj()
    assert strip_response(COMPL, o, LP) is True
    assert o == {"prompt_token_ids": [1], "choices": [
        "junk", {"index": 0, "token_ids": [2], "prompt_token_ids": [9], "logprobs": None},
        {"index": 1, "token_ids": None}]}
    o = obj()
    assert strip_response(COMPL, o, {"token_ids": False, "logprobs": "keep"}) is False
    assert o == obj()
    o = obj()
    assert strip_response(COMPL, o, {}) is False and o == obj()
    # Only a choice changed: still True (the |= is kept across choices).
    o = {"choices": [{"logprobs": 1}, {"logprobs": None}]}
    assert strip_response(CHAT, o, LP) is True
    o = {"prompt_token_ids": [1], "choices": [{"logprobs": None}]}
    assert strip_response(CHAT, o, BOTH) is True and o == {"prompt_token_ids": None, "choices": [{"logprobs": None}]}
    o = {"choices": [{"index": 0, "token_ids": [1]}]}
    assert strip_response(CHAT, o, IDS) is True and o == {"choices": [{"index": 0, "token_ids": None}]}
    o = {"choices": [{"index": 0, "prompt_token_ids": [1]}]}
    assert strip_response(COMPL, o, IDS) is True and o == {"choices": [{"index": 0, "prompt_token_ids": None}]}
    for o in ({"choices": None}, {"choices": {"a": 1}}, {"choices": "x"}, {}):
        before = dict(o)
        assert strip_response(CHAT, o, BOTH) is False and o == before


def test_strip_targets_in_order():
    ch0 = {"token_ids": [2], "prompt_token_ids": [9], "logprobs": {}}
    ch1 = {"token_ids": None, "prompt_token_ids": None, "logprobs": None}
    ch2 = {"logprobs": 0}
    obj = {"prompt_token_ids": [1], "choices": ["x", ch0, ch1, ch2]}
    t = _strip_targets(COMPL, obj, BOTH)
    assert [(id(d), k) for d, k in t] == [(id(obj), "prompt_token_ids"), (id(ch0), "token_ids"),
                                          (id(ch0), "prompt_token_ids"), (id(ch0), "logprobs"),
                                          (id(ch2), "logprobs")]
    t = _strip_targets(CHAT, obj, BOTH)
    assert [(id(d), k) for d, k in t] == [(id(obj), "prompt_token_ids"), (id(ch0), "token_ids"),
                                          (id(ch0), "logprobs"), (id(ch2), "logprobs")]
    t = _strip_targets(COMPL, obj, IDS)
    assert [(id(d), k) for d, k in t] == [(id(obj), "prompt_token_ids"), (id(ch0), "token_ids"),
                                          (id(ch0), "prompt_token_ids")]
    t = _strip_targets(COMPL, obj, LP)
    assert [(id(d), k) for d, k in t] == [(id(ch0), "logprobs"), (id(ch2), "logprobs")]
    assert _strip_targets(COMPL, obj, {"logprobs": "keep"}) == []
    assert _strip_targets(COMPL, {"prompt_token_ids": None, "choices": None}, BOTH) == []
    assert _strip_targets(CHAT, {}, BOTH) == []


def test_stripped_json_leaves_the_object_as_it_was():
    obj = {"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [2], "logprobs": {"c": [1]}},
                                                {"index": 1, "logprobs": None}]}
    copy = orjson.loads(orjson.dumps(obj))
    out = stripped_json(CHAT, obj, BOTH)
    assert out == (b'{"prompt_token_ids":null,"choices":[{"index":0,"token_ids":null,"logprobs":null},'
                   b'{"index":1,"logprobs":null}]}')
    assert obj == copy
    assert stripped_json(CHAT, obj, LP) == (b'{"prompt_token_ids":[1],"choices":[{"index":0,"token_ids":[2],'
                                            b'"logprobs":null},{"index":1,"logprobs":null}]}')
    assert obj == copy
    assert stripped_json(CHAT, {"choices": [{"logprobs": None}]}, BOTH) is None
    assert stripped_json(CHAT, [obj], BOTH) is None
    assert stripped_json(CHAT, None, BOTH) is None
    assert stripped_json(CHAT, obj, {}) is None


def test_stripped_event_every_field_and_the_restore():
    def ev():
        return {"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [2], "prompt_token_ids": [3],
                                                      "logprobs": {"t": 1}}]}
    cases = [
        (COMPL, True, True, b'{"prompt_token_ids":null,"choices":[{"index":0,"token_ids":null,'
                            b'"prompt_token_ids":null,"logprobs":null}]}'),
        (CHAT, True, True, b'{"prompt_token_ids":null,"choices":[{"index":0,"token_ids":null,'
                           b'"prompt_token_ids":[3],"logprobs":null}]}'),
        (COMPL, True, False, b'{"prompt_token_ids":null,"choices":[{"index":0,"token_ids":null,'
                             b'"prompt_token_ids":null,"logprobs":{"t":1}}]}'),
        (COMPL, False, True, b'{"prompt_token_ids":[1],"choices":[{"index":0,"token_ids":[2],'
                             b'"prompt_token_ids":[3],"logprobs":null}]}'),
    ]
    for kind, tids, drop, want in cases:
        o = ev()
        strip = {"token_ids": tids, "logprobs": "drop" if drop else None}
        assert _stripped_event(kind, o, strip, tids, drop) == want
        assert o == ev()
    assert _stripped_event(COMPL, ev(), {}, False, False) is None
    # Each field alone is enough to rewrite the event.
    assert _stripped_event(CHAT, {"prompt_token_ids": [1], "choices": [{}]}, IDS, True, False) == (
        b'{"prompt_token_ids":null,"choices":[{}]}')
    assert _stripped_event(CHAT, {"choices": [{"token_ids": [1]}]}, IDS, True, False) == (
        b'{"choices":[{"token_ids":null}]}')
    assert _stripped_event(COMPL, {"choices": [{"prompt_token_ids": [1]}]}, IDS, True, False) == (
        b'{"choices":[{"prompt_token_ids":null}]}')
    assert _stripped_event(CHAT, {"choices": [{"logprobs": {}}]}, LP, False, True) == (
        b'{"choices":[{"logprobs":null}]}')
    assert _stripped_event(CHAT, {"choices": [{"logprobs": None, "token_ids": None}]}, BOTH, True, True) is None
    # Not vLLM's usual shape: the general strip; not an object: None.
    two = {"prompt_token_ids": [1], "choices": [{"logprobs": {}}, {"logprobs": {}}]}
    assert _stripped_event(CHAT, two, BOTH, True, True) == (
        b'{"prompt_token_ids":null,"choices":[{"logprobs":null},{"logprobs":null}]}')
    assert two == {"prompt_token_ids": [1], "choices": [{"logprobs": {}}, {"logprobs": {}}]}
    assert _stripped_event(CHAT, {"prompt_token_ids": [1]}, IDS, True, False) == b'{"prompt_token_ids":null}'
    assert _stripped_event(CHAT, {"prompt_token_ids": [1], "choices": []}, IDS, True, False) == (
        b'{"prompt_token_ids":null,"choices":[]}')
    assert _stripped_event(CHAT, {"prompt_token_ids": [1], "choices": ["x"]}, IDS, True, False) == (
        b'{"prompt_token_ids":null,"choices":["x"]}')
    assert _stripped_event(CHAT, {"prompt_token_ids": [1], "choices": ("t",)}, IDS, True, False) == (
        b'{"prompt_token_ids":null,"choices":["t"]}')
    assert _stripped_event(CHAT, {"prompt_token_ids": [1], "choices": 7}, IDS, True, False) is None
    assert _stripped_event(CHAT, {"choices": 7}, IDS, True, False) is None
    assert _stripped_event(CHAT, [1], IDS, True, False) is None
    assert _stripped_event(CHAT, None, IDS, True, False) is None


def test_strip_stream_lf_path_exactly():
    data = (b'data: {"choices":[{"token_ids":[1]}]}\n\n'
            b'\n\n'
            b': a comment\n\n'
            b'event: chunk\ndata: {"choices":[{"logprobs":{"a":1}}]}\n\n'
            b'data: not json\n\n'
            b'data: \n\n'
            b'data: {"choices":[{"token_ids":null}]}\n\n'
            b'data: [DONE]\n\n'
            b'data: {"par')
    out, parsed, changed = strip_stream(CHAT, data, BOTH)
    assert out == (b'data: {"choices":[{"token_ids":null}]}\n\n'
                   b'\n\n'
                   b': a comment\n\n'
                   b'event: chunk\ndata: {"choices":[{"logprobs":null}]}\n\n'
                   b'data: not json\n\n'
                   b'data: \n\n'
                   b'data: {"choices":[{"token_ids":null}]}\n\n'
                   b'data: [DONE]\n\n'
                   b'data: {"par')
    assert parsed == [{"choices": [{"token_ids": [1]}]}, {"choices": [{"logprobs": {"a": 1}}]}, None, None,
                      {"choices": [{"token_ids": None}]}]
    assert changed == 2
    # data:[DONE] without the space is parsed by the general block parser and skipped too.
    out, parsed, changed = strip_stream(CHAT, b'data:[DONE]\n\ndata:{"prompt_token_ids":[4]}\n\n', IDS)
    assert out == b'data:[DONE]\n\ndata: {"prompt_token_ids":null}\n\n'
    assert parsed == [{"prompt_token_ids": [4]}] and changed == 1
    # Nothing changed: the very same bytes.
    same = b'data: {"choices":[{"token_ids":[1]}]}\n\n'
    out, parsed, changed = strip_stream(CHAT, same, LP)
    assert out is same and changed == 0 and parsed == [{"choices": [{"token_ids": [1]}]}]
    out, parsed, changed = strip_stream(COMPL, b'data: {"choices":[{"prompt_token_ids":[1]}]}\n\n', IDS)
    assert out == b'data: {"choices":[{"prompt_token_ids":null}]}\n\n' and changed == 1


def test_strip_stream_crlf_path_exactly():
    data = (b'data: {"choices":[{"token_ids":[1]}]}\r\n\r\n'
            b'event: e\r\ndata: {"prompt_token_ids":[2]}\r\n\r\n'
            b'data: {"choices":[]}\r\n\r\n'
            b'data: [DONE]\r\n\r\n')
    out, parsed, changed = strip_stream(CHAT, data, IDS)
    assert out == (b'data: {"choices":[{"token_ids":null}]}\n\n'
                   b'event: e\ndata: {"prompt_token_ids":null}\n\n'
                   b'data: {"choices":[]}\r\n\r\n'
                   b'data: [DONE]\r\n\r\n')
    assert parsed == [{"choices": [{"token_ids": [1]}]}, {"prompt_token_ids": [2]}, {"choices": []}]
    assert changed == 2
    same = b'data: {"choices":[]}\r\n\r\n: c\r\n\r\n'
    out, parsed, changed = strip_stream(CHAT, same, IDS)
    assert out is same and parsed == [{"choices": []}] and changed == 0


def test_strip_run_takes_the_fast_path_for_vllm_chat_only():
    out, events, changed = strip_run(CHAT, CHAT_RUN, BOTH)
    assert out == CHAT_RUN_STRIPPED and changed == 2
    assert events[0].__class__.__name__ == "ChatEvent"
    # Only token ids: the logprobs are kept.
    out, _, changed = strip_run(CHAT, CHAT_RUN, IDS)
    assert out == CHAT_RUN_STRIPPED.replace(b'"logprobs":null,"token_ids":null}]}\n\ndata: {"id":"a","choices"',
                                            b'"logprobs":{"content":[{"token":"token_id:5","logprob":-0.1}]},'
                                            b'"token_ids":null}]}\n\ndata: {"id":"a","choices"')
    assert changed == 2
    out, _, changed = strip_run(CHAT, CHAT_RUN, LP)
    assert out == CHAT_RUN.replace(b'{"content":[{"token":"token_id:5","logprob":-0.1}]}', b"null")
    assert changed == 1
    # Not vLLM's chat shape (CRLF) or another kind: the general path, dicts.
    crlf = CHAT_RUN.replace(b"\n\n", b"\r\n\r\n")
    out, events, changed = strip_run(CHAT, crlf, BOTH)
    assert out == CHAT_RUN_STRIPPED and changed == 2 and isinstance(events[0], dict)
    out, events, changed = strip_run(COMPL, CHAT_RUN, BOTH)
    assert changed == 2 and isinstance(events[0], dict)
    assert out == CHAT_RUN_STRIPPED
    # The fast path refuses (a token id list that is not digits): the general path.
    odd = b'data: {"id":"a","choices":[{"index":0,"token_ids":[1, 2]}]}\n\n'
    out, events, changed = strip_run(CHAT, odd, IDS)
    assert out == b'data: {"id":"a","choices":[{"index":0,"token_ids":null}]}\n\n'
    assert isinstance(events[0], dict) and changed == 1


def test_splice_chat_run_cuts_and_refusals():
    def splice(data, tids=True, drop=True):
        return splice_chat_run(data, decode_chat_run(data), tids, drop)

    assert splice(CHAT_RUN) == (CHAT_RUN_STRIPPED, 2)
    nothing = b'data: {"id":"a","choices":[{"index":0,"logprobs":null}]}\n\n'
    out = splice(nothing)
    assert out == (nothing, 0) and out[0] is nothing
    assert splice(CHAT_RUN, False, False) == (CHAT_RUN, 0)
    # Two choices in one event: one event changed, both values cut.
    two = (b'data: {"choices":[{"index":0,"logprobs":{"a":1},"token_ids":[1]},'
           b'{"index":1,"logprobs":{"b":2},"token_ids":[2,3]}]}\n\n')
    assert splice(two) == (b'data: {"choices":[{"index":0,"logprobs":null,"token_ids":null},'
                           b'{"index":1,"logprobs":null,"token_ids":null}]}\n\n', 1)
    assert splice(two, True, False) == (b'data: {"choices":[{"index":0,"logprobs":{"a":1},"token_ids":null},'
                                        b'{"index":1,"logprobs":{"b":2},"token_ids":null}]}\n\n', 1)
    # An event with only the prompt's ids.
    p = b'data: {"prompt_token_ids":[10,11],"choices":[]}\n\n'
    assert splice(p) == (b'data: {"prompt_token_ids":null,"choices":[]}\n\n', 1)
    assert splice(b'data: {"prompt_token_ids":[]}\n\n') == (b'data: {"prompt_token_ids":null}\n\n', 1)
    # The [DONE] at the end is kept.
    done = p + b"data: [DONE]\n\n"
    assert splice(done) == (b'data: {"prompt_token_ids":null,"choices":[]}\n\ndata: [DONE]\n\n', 1)
    # Refusals: the value is not where vLLM writes it.
    assert splice(b'data: {"choices":[{"logprobs":{"a":1}}]}\n\n') is None  # no comma before the key
    assert splice(b'data: {"choices":[{"index":0,"logprobs": {"a":1}}]}\n\n') is None  # a space
    assert splice(b'data: {"choices":[{"index":0,"token_ids":[1,-2]}]}\n\n', True, False) is None
    assert splice(b'data: {"choices":[{"index":0,"token_ids":[1 ]}]}\n\n', True, False) is None
    assert splice(b'data: {"choices":[{"index":0,"token_ids": [1]}]}\n\n', True, False) is None
    # An escaped quote in a string is no key: the content is kept, the ids cut.
    quoted = b'data: {"choices":[{"index":0,"delta":{"content":"\\"token_ids\\":[1]"},"token_ids":[2]}]}\n\n'
    assert splice(quoted, True, False) == (quoted.replace(b"[2]", b"null"), 1)
    # Another key ending in token_ids (not in the structs): found != wanted, refused.
    sneaky = b'data: {"choices":[{"index":0,"other_token_ids":[1],"token_ids":[2]}]}\n\n'
    assert splice(sneaky, True, False) is None
    assert splice(b'data: {"choices":[{"index":0,"other_token_ids":[1]}]}\n\n', True, False) == (
        b'data: {"choices":[{"index":0,"other_token_ids":[1]}]}\n\n', 0)
    # A second logprobs object after the last cut one (not set in the structs): refused.
    extra = b'data: {"choices":[{"index":0,"logprobs":{"a":1}}],"x":{"y":0,"logprobs":{"b":1}}}\n\n'
    assert splice(extra, False, True) is None
    # Token ids that follow a logprobs value in the same choice, and ids before it.
    after = b'data: {"choices":[{"index":0,"token_ids":[1],"logprobs":{"a":[2]},"x":1}]}\n\n'
    assert splice(after) == (b'data: {"choices":[{"index":0,"token_ids":null,"logprobs":null,"x":1}]}\n\n', 1)


def test_module_constants():
    assert inj_mod._LOGPROBS == b',"logprobs":{'
    assert inj_mod._TOKEN_IDS == b'token_ids":['
    assert inj_mod._ID_CHARS == b"0123456789,"
    assert inj_mod._dumps is orjson.dumps


# -- completions: the choices' prompt ids are stripped too -----------------------------------------


def test_completions_choices_lose_their_prompt_ids_in_bodies_and_streams():
    resp = {"id": "c", "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2], "token_ids": [3]}]}
    f = _resp_flow(resp, strip=IDS, kind=COMPL)
    Injector().response_body(f)
    assert f.response_json == {"id": "c", "choices": [{"index": 0, "text": "a", "prompt_token_ids": None,
                                                       "token_ids": None}]}
    f = _resp_flow(resp, strip=IDS, kind=CHAT)  # a chat choice's prompt_token_ids is not injected
    Injector().response_body(f)
    assert f.response_json == {"id": "c", "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2],
                                                       "token_ids": None}]}
    run = b'data: {"id":"c","choices":[{"index":0,"text":"a","prompt_token_ids":[1,2]}]}\n\n'
    out, events, changed = strip_run(COMPL, run, IDS)
    assert out == b'data: {"id":"c","choices":[{"index":0,"text":"a","prompt_token_ids":null}]}\n\n'
    assert changed == 1 and events == [{"id": "c", "choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2]}]}]


def test_splice_counts_every_prompt_id_list():
    run = (b'data: {"prompt_token_ids":[1],"choices":[]}\n\n'
           b'data: {"prompt_token_ids":[2,3],"choices":[]}\n\n')
    assert splice_chat_run(run, decode_chat_run(run), True, False) == (
        b'data: {"prompt_token_ids":null,"choices":[]}\n\n'
        b'data: {"prompt_token_ids":null,"choices":[]}\n\n', 2)


def test_the_general_strip_of_completions_keeps_the_kind():
    obj = {"choices": [{"index": 0, "prompt_token_ids": [1]}]}
    assert stripped_json(COMPL, obj, IDS) == b'{"choices":[{"index":0,"prompt_token_ids":null}]}'
    assert stripped_json(CHAT, obj, IDS) is None
    two = {"choices": [{"index": 0, "prompt_token_ids": [1]}, {"index": 1, "prompt_token_ids": [2]}]}
    assert _stripped_event(COMPL, two, IDS, True, False) == (
        b'{"choices":[{"index":0,"prompt_token_ids":null},{"index":1,"prompt_token_ids":null}]}')
    assert two == {"choices": [{"index": 0, "prompt_token_ids": [1]}, {"index": 1, "prompt_token_ids": [2]}]}


def test_a_crlf_completions_stream_loses_the_choices_prompt_ids():
    run = b'data: {"choices":[{"index":0,"prompt_token_ids":[1,2]}]}\r\n\r\n'
    assert strip_stream(COMPL, run, IDS) == (
        b'data: {"choices":[{"index":0,"prompt_token_ids":null}]}\n\n',
        [{"choices": [{"index": 0, "prompt_token_ids": [1, 2]}]}], 1)
