"""The relay's fast path equals the event-by-event definitions it replaces: the splitter cuts
where `SSEParser` does, `strip_stream` relays what `strip_response` + `SSEEvent.set_json` give,
the typed decode and byte splice of vLLM's chat events (`strip_run`) relay the same JSON, and
accumulators fed raw bytes, dicts or the typed events record what `add_event` does."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

import json

from tensorverse.jsonbytes import dumps
from tensorverse.proxy.events import ChatEvent, decode_chat_run
from tensorverse.proxy.inject import splice_chat_run, strip_response, strip_run, strip_stream
from tensorverse.proxy.accumulate import Accumulator, ChatAccumulator, CompletionAccumulator
from tensorverse.proxy.sse import SSEParser, SSESplitter
from tensorverse.store.turns import read_turn

CHAT_STRIP = {"token_ids": True, "logprobs": "drop"}


def read(acc: Accumulator) -> dict:
    """The recorded response as a reader gets it: stored (JSON) and read back (`read_turn`)."""
    return read_turn(orjson.loads(dumps(acc.result())))


def _chat_event(i: int, *, tids: bool = True, lp: bool = True, first: bool = False) -> dict:
    ev = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
          "choices": [{"index": 0, "delta": {"content": f"t{i} "},
                       "logprobs": {"content": [{"token": f"token_id:{1000 + i}", "logprob": -0.25, "bytes": [116],
                                                 "top_logprobs": [{"token": f"token_id:{1000 + i + r}",
                                                                   "logprob": -0.25 * (r + 1), "bytes": None}
                                                                  for r in range(3)]}]} if lp else None,
                       "finish_reason": None, "token_ids": [1000 + i] if tids else None}]}
    if first:
        ev["prompt_token_ids"] = [1, 2, 3]
    return ev


def _stream() -> bytes:
    parts = [b"data: " + orjson.dumps(_chat_event(0, first=True)) + b"\n\n",
             b": keep-alive\n\n",
             b"event: note\ndata: " + orjson.dumps(_chat_event(1)) + b"\n\n",
             b"data: not json\n\n",
             b"data: \n\n",
             b"data: {\"multi\":\ndata: 1}\n\n"]
    parts += [b"data: " + orjson.dumps(_chat_event(i, lp=i % 2 == 0)) + b"\n\n" for i in range(2, 6)]
    parts += [b"data: " + orjson.dumps({"choices": [], "usage": {"prompt_tokens": 3}}) + b"\n\n",
              b"data: [DONE]\n\n"]
    return b"".join(parts)


STREAM = _stream()


def _reference_strip(kind, data: bytes, strip) -> bytes:
    evs = SSEParser().feed(data)
    for ev in evs:
        obj = ev.json
        if isinstance(obj, dict) and strip_response(kind, obj, strip):
            ev.set_json(obj)
    return b"".join(ev.raw for ev in evs)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=10), st.booleans(), st.booleans())
def test_splitter_and_strip_equal_event_by_event(cuts, crlf, extra_newlines):
    stream = STREAM
    if extra_newlines:
        stream = stream.replace(b": keep-alive\n\n", b": keep-alive\n\n\n")
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    cuts = sorted({min(c, len(stream)) for c in cuts})
    splitter, parser = SSESplitter(), SSEParser()
    relayed, reference = [], []
    prev = 0
    for c in cuts + [len(stream)]:
        piece = stream[prev:c]
        prev = c
        data = splitter.feed(piece)
        expected = b"".join(ev.raw for ev in parser.feed(piece))
        assert data == expected  # the same complete events, in the same pieces
        if data:
            out, parsed, _ = strip_stream("chat.completions", data, CHAT_STRIP)
            relayed.append(out)
            reference.append(_reference_strip("chat.completions", data, CHAT_STRIP))
            ref_events = [ev for ev in SSEParser().feed(data) if ev.data is not None and not ev.done]
            assert parsed == [ev.json for ev in ref_events]  # unstripped, as the upstream sent them
    assert splitter.tail() == parser.tail()
    assert b"".join(relayed) == b"".join(reference)


def test_strip_keeps_the_parsed_objects_whole():
    data = b"data: " + orjson.dumps(_chat_event(0, first=True)) + b"\n\n"
    out, parsed, changed = strip_stream("chat.completions", data, CHAT_STRIP)
    assert changed == 1 and parsed == [_chat_event(0, first=True)]
    sent = orjson.loads(out[6:])
    assert sent["prompt_token_ids"] is None and sent["choices"][0]["token_ids"] is None
    assert sent["choices"][0]["logprobs"] is None and sent["choices"][0]["delta"] == {"content": "t0 "}
    # nothing to strip: the same bytes object
    plain = b"data: " + orjson.dumps(_chat_event(1, tids=False, lp=False)) + b"\n\n"
    assert strip_stream("chat.completions", plain, CHAT_STRIP)[0] is plain


def test_completions_strip_prompt_token_ids_in_choice():
    ev = {"choices": [{"index": 0, "text": "a", "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-1.0],
                                                             "top_logprobs": [{"token_id:5": -1.0}],
                                                             "text_offset": [0]},
                       "finish_reason": None, "prompt_token_ids": [1, 2], "token_ids": [5]}]}
    data = b"data: " + orjson.dumps(ev) + b"\n\n"
    out, _, changed = strip_stream("completions", data, {"token_ids": True, "logprobs": "drop"})
    assert changed == 1
    assert out == _reference_strip("completions", data, {"token_ids": True, "logprobs": "drop"})
    assert orjson.loads(out[6:])["choices"][0] == {"index": 0, "text": "a", "logprobs": None, "finish_reason": None,
                                                  "prompt_token_ids": None, "token_ids": None}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=6), st.booleans())
def test_raw_fed_accumulator_equals_add_event(cuts, via_injector):
    ref = ChatAccumulator()
    unparsed = 0
    for ev in SSEParser().feed(STREAM):  # what the recorder's per-event hook did
        if ev.data is not None and not ev.done:
            if ev.json is None:
                unparsed += 1
            else:
                ref.add_event(ev.json)
    acc = ChatAccumulator()
    splitter = SSESplitter()
    prev = 0
    for i, c in enumerate(sorted(set(cuts)) + [len(STREAM)]):
        data = splitter.feed(STREAM[prev:c])
        prev = c
        if data:
            parsed = strip_stream("chat.completions", data, CHAT_STRIP)[1] if via_injector else None
            acc.feed_raw(data, float(i), parsed)
    assert read(acc) == read(ref)
    assert acc.unparsed_events == unparsed == 2  # "not json" and the empty data
    assert acc.first_token_t is not None
    assert acc.result() is acc.result()  # computed once


def test_result_recomputed_after_more_events():
    acc = CompletionAccumulator()
    acc.add_event({"choices": [{"index": 0, "text": "a"}]})
    assert acc.result()["text"] == "a"
    acc.add_event({"choices": [{"index": 0, "text": "b"}]})
    assert acc.result()["text"] == "ab"


def test_malformed_event_does_not_stop_the_stripping_of_the_others():
    good = [b"data: " + orjson.dumps(_chat_event(i)) + b"\n\n" for i in range(3)]
    two = {"choices": [_chat_event(7)["choices"][0], {**_chat_event(8)["choices"][0], "index": 1}]}
    data = (good[0] + b'data: {"choices": 7, "usage": "x"}\n\n' + good[1] + b"data: " + orjson.dumps(two)
            + b"\n\n" + b'data: {"choices": [1, {"token_ids": [5], "logprobs": null}]}\n\n' + good[2])
    out, parsed, changed = strip_stream("chat.completions", data, CHAT_STRIP)
    assert changed == 5 and len(parsed) == 6
    events = [orjson.loads(ev.data) for ev in SSEParser().feed(out)]
    assert events[1] == {"choices": 7, "usage": "x"}  # as it came
    for ev in (events[0], events[2], events[5]):
        assert ev["choices"][0]["token_ids"] is None and ev["choices"][0]["logprobs"] is None
    assert [c["token_ids"] for c in events[3]["choices"]] == [None, None]
    assert [c["logprobs"] for c in events[3]["choices"]] == [None, None]
    assert events[4] == {"choices": [1, {"token_ids": None, "logprobs": None}]}
    assert parsed[0] == _chat_event(0)  # the recorder gets the upstream's objects, unstripped



# -- the typed decode and byte splice of vLLM's chat events --------------------------------------

# Text that looks like the structure the splice searches for, inside JSON strings.
_TRICKY = st.sampled_from([',"logprobs":{', '"token_ids":[1,2]', ',"finish_reason":', "\n", '"', "\\", "}]",
                           "data: ", "\n\ndata: ", "token_ids\"", "]", "{", "é ✓", "\u2028"])
_TEXT = st.lists(st.one_of(st.text(max_size=6), _TRICKY), max_size=4).map("".join)


@st.composite
def _vllm_chat_run(draw, odd: bool = False) -> list[dict]:
    """Events of vLLM 0.32's chat stream shape, with what the proxy injects set or not; ``odd``:
    some delta values of other JSON types too."""
    events = []
    n = draw(st.integers(1, 6))
    for i in range(n):
        choices = []
        for index in range(draw(st.integers(1, 2))):
            delta: dict = {}
            if draw(st.booleans()):
                delta["content"] = draw(_TEXT)
            if draw(st.integers(0, 4)) == 0:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": draw(_TEXT),
                                                                 **({"name": draw(st.sampled_from(["f", 3, None]))}
                                                                    if draw(st.booleans()) else {})}}]
            if draw(st.integers(0, 4)) == 0:
                delta["role"] = draw(st.sampled_from(["assistant", "", None]))
            if draw(st.integers(0, 4)) == 0:
                delta[draw(st.sampled_from(["reasoning", "reasoning_content"]))] = draw(st.one_of(_TEXT, st.none()))
            if odd and draw(st.integers(0, 4)) == 0:  # values of other types (not vLLM's, but JSON)
                key = draw(st.sampled_from(["content", "tool_calls", "role", "reasoning"]))
                delta[key] = draw(st.sampled_from([5, None, ["x"], {"a": 1}, True, [1, "y"]]))
            token = st.one_of(st.integers(0, 200000).map(lambda t: f"token_id:{t}"), _TEXT)
            lp = None
            if draw(st.booleans()):
                lp = {"content": [
                    {"token": draw(token), "logprob": draw(st.floats(-30, 0)), "bytes": draw(st.lists(st.integers(0, 255), max_size=3)),
                     "top_logprobs": [{"token": draw(token), "logprob": draw(st.floats(-30, 0)), "bytes": None}
                                      for _ in range(draw(st.integers(0, 3)))]}
                    for _ in range(draw(st.integers(0, 2)))]}
            ch = {"index": index, "delta": delta, "logprobs": lp,
                  "finish_reason": draw(st.sampled_from([None, "stop", "tool_calls"]))}
            if draw(st.booleans()):
                ch["token_ids"] = draw(st.lists(st.integers(0, 200000), max_size=3))
            choices.append(ch)
        ev = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices}
        if i == 0 and draw(st.booleans()):
            ev["prompt_token_ids"] = draw(st.lists(st.integers(0, 200000), min_size=1, max_size=5))
        if i == n - 1 and draw(st.booleans()):
            ev["usage"] = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        events.append(ev)
    return events


def _sse(events: list[dict], dumps=orjson.dumps, done: bool = False) -> bytes:
    return b"".join(b"data: " + dumps(ev) + b"\n\n" for ev in events) + (b"data: [DONE]\n\n" if done else b"")


def _same_events(out: bytes, reference: bytes) -> None:
    got = [(ev.event, ev.json if ev.json is not None else ev.data) for ev in SSEParser().feed(out)]
    want = [(ev.event, ev.json if ev.json is not None else ev.data) for ev in SSEParser().feed(reference)]
    assert got == want


@settings(max_examples=300, deadline=None)
@given(_vllm_chat_run(), st.booleans(), st.booleans(), st.booleans())
def test_splice_relays_what_the_reference_strip_relays(events, tids, drop, done):
    data = _sse(events, done=done)
    strip = {"token_ids": tids, "logprobs": "drop" if drop else None}
    decoded = decode_chat_run(data)
    assert decoded is not None and len(decoded) == len(events)  # vLLM's shape takes the fast path
    cut = splice_chat_run(data, decoded, tids, drop)
    assert cut is not None  # ... all of it: the values are found where vLLM writes them
    out, parsed, changed = strip_run("chat.completions", data, strip)
    reference = _reference_strip("chat.completions", data, strip)
    _same_events(out, reference)
    assert changed == strip_stream("chat.completions", data, strip)[2]
    assert all(e.__class__ is ChatEvent for e in parsed)
    # what the splice does not null is relayed as the upstream's own bytes
    for sent, upstream in zip(SSEParser().feed(out), SSEParser().feed(data)):
        if sent.json == upstream.json:
            assert sent.raw == upstream.raw


@settings(max_examples=150, deadline=None)
@given(_vllm_chat_run(odd=True))
def test_typed_events_record_what_add_event_records(events):
    data = _sse(events, done=True)
    ref = ChatAccumulator()
    for ev in events:  # the general path, event by event (an event it cannot fold counts as unparsed)
        ref.fold_run([orjson.loads(orjson.dumps(ev))])
    typed = ChatAccumulator()
    typed.feed_raw(data, 1.0, strip_run("chat.completions", data, {"token_ids": True, "logprobs": "drop"})[1])
    raw = ChatAccumulator()
    raw.feed_raw(data, 1.0)  # the recorder decodes it itself (no injection)
    assert read(typed) == read(ref) == read(raw)
    assert typed.events == ref.events and typed.unparsed_events == ref.unparsed_events == raw.unparsed_events
    if decode_chat_run(data) is None or typed.unparsed_events:  # odd values: the general path took
        return  # the run, or an event was not folded whole (nor was it on the general path)
    # the fast path kept the logprobs as received: nothing decoded on the relay path
    for choice in typed.result()["choices"]:
        assert choice["logprobs"] is None
        lps = [c["logprobs"] for ev in events for c in ev.get("choices") or () if c.get("index", 0) == choice["index"]]
        assert ("upstream_logprobs" in choice) == any(lp is not None for lp in lps)


@settings(max_examples=100, deadline=None)
@given(_vllm_chat_run())
def test_other_layouts_fall_back_to_the_reference_strip(events):
    """Spaces after separators (not how vLLM writes), or logprobs as the last member of a
    choice: the splice finds fewer values than the events hold and the run is stripped event by
    event; the relayed JSON is the same either way."""
    strip = {"token_ids": True, "logprobs": "drop"}
    spaced = _sse(events, dumps=lambda ev: json.dumps(ev).encode())
    out, _parsed, _ = strip_run("chat.completions", spaced, strip)
    _same_events(out, _reference_strip("chat.completions", spaced, strip))
    reordered = [{**ev, "choices": [{k: c[k] for k in sorted(c, key=lambda k: k == "logprobs")} for c in ev["choices"]]}
                 for ev in events]
    data = _sse(reordered)
    out, _parsed, _ = strip_run("chat.completions", data, strip)
    _same_events(out, _reference_strip("chat.completions", data, strip))


def test_splice_refuses_what_is_not_vllms_shape():
    ev = _chat_event(0)
    nested = b"data: " + orjson.dumps({**ev, "choices": [{**ev["choices"][0], "token_ids": [[1], [2]]}]}) + b"\n\n"
    assert splice_chat_run(nested, decode_chat_run(nested), True, True) is None
    last = {**ev, "choices": [{"index": 0, "delta": {}, "token_ids": None, "logprobs": ev["choices"][0]["logprobs"]}]}
    two = b"data: " + orjson.dumps(last) + b"\n\n" + b"data: " + orjson.dumps(_chat_event(1)) + b"\n\n"
    cut = splice_chat_run(two, decode_chat_run(two), True, True)  # logprobs last: cut exactly, not up to
    assert cut is not None and cut[1] == 2  # the next "finish_reason" (in the next event)
    _same_events(cut[0], _reference_strip("chat.completions", two, CHAT_STRIP))
    extra = b"data: " + orjson.dumps({**ev, "x": {"a": 1, "logprobs": {"content": []}}}) + b"\n\n"  # a "logprobs" not vLLM's
    assert splice_chat_run(extra, decode_chat_run(extra), True, True) is None
    # runs that are not plain data events are not decoded at all
    for run in (b": ping\n\n", b"event: x\ndata: {}\n\n", b"data: {\"a\":1},{\"b\":2}\n\n",
                b'data: {"choices": 7}\n\n', b"data: {}\r\n\r\n", b"data: not json\n\n",
                b'data: {}\n\ndata: {"a":1},{"b":2}\n\n', b'data: {"a":1}\n\ndata: {"b":\n2}\n\n',
                b'data: {}\n\ndata: {}\n\n\n\n', b'data: {}\n\n: ping\n\ndata: {}\n\n'):
        assert decode_chat_run(run) is None, run
    assert decode_chat_run(b"data: [DONE]\n\n") == []
    assert len(decode_chat_run(b'data: {}\n\ndata: {"choices":[]}\n\ndata: [DONE]\n\n')) == 2


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_malformed_events_cost_the_turn_nothing_else(cuts):
    """Garbage in the middle of a stream (the fake's X-Fake-Malformed events: broken JSON,
    invalid UTF-8, a line without a colon, an event whose "choices" is 7, a comment): the turn
    records every other event, however the stream is cut into reads; before, the "choices": 7
    event stopped the fold and the turn was recorded truncated, or not at all."""
    from tensorverse.testing.fake_upstream import MALFORMED_EVENTS

    good = [b"data: " + orjson.dumps(_chat_event(i, first=i == 0)) + b"\n\n" for i in range(6)] + [b"data: [DONE]\n\n"]
    events = good[:3] + MALFORMED_EVENTS + good[3:]
    reference = ChatAccumulator()
    reference.feed_raw(b"".join(good), 0.0)
    bounds = sorted({min(c, len(events)) for c in cuts} | {len(events)})
    acc = ChatAccumulator()
    prev = 0
    for b in bounds:
        run = b"".join(events[prev:b])
        prev = b
        if run:
            acc.feed_raw(run, 0.0, strip_run("chat.completions", run, CHAT_STRIP)[1])
    assert read(acc) == read(reference)
    assert acc.unparsed_events == 2  # the broken JSON and the invalid UTF-8; "choices": 7 folds to nothing
