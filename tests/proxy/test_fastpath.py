"""The relay's fast path equals the event-by-event definitions it replaces: the splitter cuts
where `SSEParser` does, `strip_stream` relays what `strip_response` + `SSEEvent.set_json` give,
and accumulators fed raw bytes (or the injector's parsed objects) record what `add_event` does."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorverse.proxy.inject import strip_response, strip_stream
from tensorverse.proxy.protocol import ChatAccumulator, CompletionAccumulator, SSEParser, SSESplitter

CHAT_STRIP = {"token_ids": True, "logprobs": "drop"}


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
    assert acc.result() == ref.result()
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
