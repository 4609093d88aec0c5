"""Wire-format pieces: SSE parsing, accumulators, stripping, session canonical forms."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorverse.proxy.inject import Injector, strip_response
from tensorverse.proxy.accumulate import ChatAccumulator, CompletionAccumulator, MessagesAccumulator
from tensorverse.proxy.protocol import endpoint_kind
from tensorverse.proxy.sse import SSEParser
from tensorverse.proxy.sessions import canonical_message, chain

STREAM = (b'data: {"a": 1}\n\n'
          b'event: message_start\ndata: {"type": "message_start"}\n\n'
          b': keep-alive comment\n\n'
          b'data: {"multi":\ndata: 2}\n\n'
          b"data: [DONE]\n\n")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=8))
def test_sse_parser_any_chunking_keeps_bytes(cuts):
    cuts = sorted(set(cuts))
    parser = SSEParser()
    events = []
    prev = 0
    for c in cuts + [len(STREAM)]:
        events += parser.feed(STREAM[prev:c])
        prev = c
    assert b"".join(e.raw for e in events) == STREAM and parser.tail() == b""
    assert [e.json for e in events] == [{"a": 1}, {"type": "message_start"}, None, {"multi": 2}, None]
    assert events[1].event == "message_start" and events[4].done


def test_sse_parser_crlf_and_tail():
    p = SSEParser()
    evs = p.feed(b'data: {"x": 1}\r\n\r\ndata: {"y"')
    assert [e.json for e in evs] == [{"x": 1}] and evs[0].raw == b'data: {"x": 1}\r\n\r\n'
    assert p.tail() == b'data: {"y"'


def test_endpoint_kind():
    assert endpoint_kind("POST", "/v1/chat/completions") == "chat.completions"
    assert endpoint_kind("POST", "/v1/completions/") == "completions"
    assert endpoint_kind("POST", "/v1/messages") == "messages"
    assert endpoint_kind("GET", "/v1/chat/completions") is None
    assert endpoint_kind("POST", "/tokenize") is None


def test_chat_accumulator_stream_details():
    acc = ChatAccumulator()
    chunks = [
        {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
         "prompt_token_ids": [1, 2]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}, "token_ids": [7]}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t0", "type": "function",
                                                             "function": {"name": "show_", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "interface",
                                                                                      "arguments": '{"na'}}]},
                      "token_ids": [8]}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "t1", "function": {"name": "ping",
                                                                                                 "arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'me": "Gi0"}'}}]},
                      "token_ids": [9]}]},
        {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "tool_calls", "stop_reason": None}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    ]
    outputs = [acc.add_event(c) for c in chunks]
    assert outputs == [False, True, True, True, True, True, False, False]
    r = acc.result()
    assert r["prompt_token_ids"] == [1, 2] and r["output_token_ids"] == [7, 8, 9]
    assert r["reasoning"] == "hmm" and r["text"] == "" and r["finish_reason"] == "tool_calls"
    assert r["tool_calls"] == [
        {"id": "t0", "type": "function", "function": {"name": "show_interface", "arguments": '{"name": "Gi0"}'}},
        {"id": "t1", "type": "function", "function": {"name": "ping", "arguments": "{}"}},
    ]
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 3} and r["response_id"] == "c1"


def test_completion_accumulator_logprobs_token_ids():
    acc = CompletionAccumulator()
    acc.add_body({"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6], "prompt_token_ids": [1],
                               "finish_reason": "length",
                               "logprobs": {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-1.0, -2.0],
                                            "top_logprobs": [{"token_id:5": -1.0, "token_id:9": -3.0}, None]}}]})
    r = acc.result()
    assert r["output_token_ids"] == [5, 6] and r["prompt_token_ids"] == [1]
    assert r["choices"][0]["logprobs"] == [{"token": 5, "logprob": -1.0, "top": [[5, -1.0], [9, -3.0]]},
                                           {"token": 6, "logprob": -2.0, "top": []}]


def test_messages_accumulator_body_and_stream_agree():
    body = {"id": "m1", "model": "x", "content": [{"type": "thinking", "thinking": "t"}, {"type": "text", "text": "hi"},
                                                  {"type": "tool_use", "id": "u1", "name": "f", "input": {"a": 1}}],
            "stop_reason": "tool_use", "usage": {"input_tokens": 3, "output_tokens": 4}}
    a = MessagesAccumulator()
    a.add_body(body)
    b = MessagesAccumulator()
    for ev in [
        {"type": "message_start", "message": {"id": "m1", "model": "x", "usage": {"input_tokens": 3}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "t"}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "hi"}},
        {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "u1", "name": "f", "input": {}}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"a":'}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": " 1}"}},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 4}},
    ]:
        b.add_event(ev)
    ra, rb = a.result(), b.result()
    assert ra["text"] == rb["text"] == "hi" and ra["reasoning"] == rb["reasoning"] == "t"
    assert orjson.loads(ra["tool_calls"][0]["function"]["arguments"]) == orjson.loads(rb["tool_calls"][0]["function"]["arguments"])
    assert ra["finish_reason"] == rb["finish_reason"] == "tool_use" and ra["usage"] == rb["usage"]


def test_injection_plan_and_strip():
    inj = Injector(top_logprobs=5)
    add, strip = inj.plan("chat.completions", {"messages": []})
    assert add == {"return_token_ids": True, "logprobs": True, "top_logprobs": 5, "return_tokens_as_token_ids": True}
    add, strip = inj.plan("chat.completions", {"messages": [], "logprobs": True, "top_logprobs": 1})
    assert add == {"return_token_ids": True}  # the client's own logprobs request is left alone
    add, _ = inj.plan("chat.completions", {"messages": [], "return_token_ids": True, "logprobs": True})
    assert add == {}
    add, _ = inj.plan("messages", {"messages": []})
    assert add == {}
    obj = {"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [2], "logprobs": {"content": []}},
                                                {"index": 1, "delta": {}}]}
    assert strip_response("chat.completions", obj, {"token_ids": True, "logprobs": "drop"})
    assert obj == {"prompt_token_ids": None, "choices": [{"index": 0, "token_ids": None, "logprobs": None},
                                                         {"index": 1, "delta": {}}]}


def test_canonical_messages_survive_resend_variants():
    a = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": "z"}'}}]}
    b = {"role": "assistant", "content": "", "reasoning_content": "...", "tool_calls": [
        {"id": "y", "function": {"name": "f", "arguments": '{"a":"z","b":1}'}}]}
    assert canonical_message(a) == canonical_message(b)
    assert canonical_message({"role": "user", "content": [{"type": "text", "text": " hi "}]}) == \
        canonical_message({"role": "user", "content": "hi"})
    assert canonical_message({"role": "user", "content": "hi"}) != canonical_message({"role": "user", "content": "ho"})
    h = chain([{"role": "user", "content": "1"}, {"role": "user", "content": "2"}])
    assert len(h) == 2 and h[0] == chain([{"role": "user", "content": "1"}])[0]
