"""Injection and stripping: ask the primary for what recording needs, hide it from the client.

For ``/v1/chat/completions`` and ``/v1/completions`` the proxy may add ``return_token_ids``
(exact prompt and output token ids) and ``logprobs``/``top_logprobs`` (top-k per output token,
with ``return_tokens_as_token_ids`` when the client asked for no logprobs at all, so tokens that
decode alike stay apart). Whatever the client did not ask for is put back the way vLLM writes it
for a request without it (vLLM 0.32 writes those fields as ``null``, it never omits them), in the
whole body and in every streamed event, so the client parses the same objects as a direct call.
A client that asks for logprobs itself gets exactly what it asked for (the proxy records those):
asking for more and trimming would not be invisible, because tokens tied at the boundary rank
differently for another k.

If the upstream rejects the injected request (400/422: an older vLLM, a lower ``--max-logprobs``),
the core resends the client's own body; the injector then stops injecting what was rejected.

A stream is stripped a run of complete events at a time, before the run is relayed
(`Injector.stream_rewrite`). vLLM's chat events take the fast path: the run is decoded once into
typed structs (`tensorverse.proxy.events`), which tell how many fields are to be nulled, and the
injected values are cut out of the upstream's own bytes and replaced by ``null``
(`splice_chat_run`); everything else of the event is relayed as the upstream wrote it. The cut is
only made when every field the structs say is set was found where vLLM writes it (key, value
shape, inside its own event); otherwise, and for any other kind or shape, the run takes the
general path (`strip_stream`): each event parsed with orjson, the injected fields nulled for the
serialisation only. Either way the decoded events go to the recorder, which so never parses the
stream again. (Measured with callgrind, 2026-11-30: orjson's parse + serialisation of a 32-event
stream with top-5 logprobs was 1.6 M instructions, a third of the proxy's work per request.)
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from tensorverse.jsonbytes import dumps
from tensorverse.proxy.events import NULL, ChatEvent, decode_chat_run
from tensorverse.proxy.flow import Addon, Flow
from tensorverse.proxy.protocol import CHAT, COMPLETIONS
from tensorverse.proxy.sse import SSEParser, _parse_block

log = logging.getLogger("tensorverse.proxy.inject")


class Injector(Addon):
    name = "inject"

    def __init__(self, *, return_token_ids: bool = True, top_logprobs: int = 5) -> None:
        self.return_token_ids = return_token_ids
        self.top_logprobs = top_logprobs
        self.counters = {"injected": 0, "stripped_events": 0, "rejected": 0}

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "return_token_ids": self.return_token_ids, "top_logprobs": self.top_logprobs}

    # -- request ---------------------------------------------------------------------------------
    def plan(self, kind: str | None, req: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(parameters to add, strip plan) for a client request body."""
        if kind not in (CHAT, COMPLETIONS) or not isinstance(req, dict):
            return {}, {}
        add: dict[str, Any] = {}
        strip: dict[str, Any] = {}
        if self.return_token_ids and not req.get("return_token_ids"):
            add["return_token_ids"] = True
            strip["token_ids"] = True
        k = self.top_logprobs
        # Logprobs are only added when the client asked for none. A client that asked for its own
        # gets exactly its request: asking vLLM for more and trimming is not invisible (ties at
        # the boundary rank differently for another k; seen with bf16 logits on vLLM 0.32).
        if k > 0 and not req.get("use_beam_search") and not req.get("logprob_token_ids"):
            if kind == CHAT and not req.get("logprobs") and req.get("top_logprobs") is None:
                add.update(logprobs=True, top_logprobs=k)
                strip["logprobs"] = "drop"
            elif kind == COMPLETIONS and req.get("logprobs") is None:
                add["logprobs"] = k
                strip["logprobs"] = "drop"
            if strip.get("logprobs") == "drop" and "return_tokens_as_token_ids" not in req:
                add["return_tokens_as_token_ids"] = True
        return add, strip

    async def request(self, flow: Flow) -> None:
        add, strip = self.plan(flow.kind, flow.request_json)
        if not add:
            return
        flow.upstream_body = dumps({**flow.request_json, **add})
        flow.injected = add
        flow.strip = strip
        self.counters["injected"] += 1

    async def response_done(self, flow: Flow) -> None:
        if flow.retried_without_injection:
            self.counters["rejected"] += 1
            if (flow.status or 500) < 400:
                # The plain request worked where the injected one did not: stop injecting.
                log.warning(
                    "the primary rejects injected recording parameters (%s); recording continues "
                    "without exact token ids/logprobs. Upstream said: %s",
                    ", ".join(sorted(flow.strip or {})) or "?",
                    (flow.upstream_rejection or "")[:300],
                )
                self.return_token_ids = False
                self.top_logprobs = 0

    # -- response --------------------------------------------------------------------------------
    def response_body(self, flow: Flow) -> None:
        strip = flow.strip
        if not strip or not flow.injected or (flow.status or 500) >= 400:
            return
        body = flow.response_json
        if isinstance(body, dict) and strip_response(flow.kind, body, strip):
            flow.set_response_json(body)

    def stream_rewrite(self, flow: Flow, data: bytes) -> bytes:
        strip = flow.strip
        if not strip or not flow.injected:
            return data
        out, parsed, changed = strip_run(flow.kind, data, strip)
        self.counters["stripped_events"] += changed
        flow.parsed_events = (data, parsed)  # the recorder reuses them (`Recorder.stream_data`)
        return out


def strip_run(kind: str | None, data: bytes, strip: dict[str, Any]) -> tuple[bytes, list[Any], int]:
    """Strip a run of complete events: (bytes to relay, the decoded events, events changed).

    vLLM's chat events take the fast path (`decode_chat_run` + `splice_chat_run`: the events
    come back as `ChatEvent` structs); anything else `strip_stream` (orjson dicts)."""
    if kind == CHAT:
        events = decode_chat_run(data)
        if events is not None:
            cut = splice_chat_run(data, events, bool(strip.get("token_ids")), strip.get("logprobs") == "drop")
            if cut is not None:
                return cut[0], events, cut[1]
    return strip_stream(kind, data, strip)


def _null(d: dict, key: str) -> bool:
    if d.get(key) is not None:
        d[key] = None
        return True
    return False


def strip_response(kind: str | None, obj: dict, strip: dict[str, Any]) -> bool:
    """Undo injection in one response body or stream event, in place; True if it changed."""
    changed = False
    lp = strip.get("logprobs")
    if strip.get("token_ids"):
        changed |= _null(obj, "prompt_token_ids")
    choices = obj.get("choices")
    for ch in choices if isinstance(choices, list) else ():
        if not isinstance(ch, dict):
            continue
        if strip.get("token_ids"):
            changed |= _null(ch, "token_ids")
            if kind == COMPLETIONS:
                changed |= _null(ch, "prompt_token_ids")
        if lp == "drop":
            changed |= _null(ch, "logprobs")
    return changed



# -- streams -----------------------------------------------------------------------------------


def _strip_targets(kind: str | None, obj: dict, strip: dict[str, Any]) -> list[tuple[dict, str]]:
    """The (dict, key) pairs `strip_response` would set to null (their values are not null)."""
    out: list[tuple[dict, str]] = []
    tids = strip.get("token_ids")
    drop = strip.get("logprobs") == "drop"
    if tids and obj.get("prompt_token_ids") is not None:
        out.append((obj, "prompt_token_ids"))
    for ch in obj.get("choices") or ():
        if not isinstance(ch, dict):
            continue
        if tids:
            if ch.get("token_ids") is not None:
                out.append((ch, "token_ids"))
            if kind == COMPLETIONS and ch.get("prompt_token_ids") is not None:
                out.append((ch, "prompt_token_ids"))
        if drop and ch.get("logprobs") is not None:
            out.append((ch, "logprobs"))
    return out


def stripped_json(kind: str | None, obj: Any, strip: dict[str, Any]) -> bytes | None:
    """``obj`` as JSON with the injected fields nulled (as `strip_response` does), None when
    nothing is to be stripped; ``obj`` itself is left as it was (the recorder keeps it)."""
    if not isinstance(obj, dict):
        return None
    targets = _strip_targets(kind, obj, strip)
    if not targets:
        return None
    saved = [d[k] for d, k in targets]
    for d, k in targets:
        d[k] = None
    try:
        return orjson.dumps(obj)
    finally:
        for (d, k), v in zip(targets, saved):
            d[k] = v


_dumps = orjson.dumps


def _stripped_event(kind: str | None, obj: Any, strip: dict[str, Any], tids: bool, drop: bool) -> bytes | None:
    """`stripped_json` for one stream event, with vLLM's usual shape (an object with one choice
    object) taken without building the list of targets: each event of a stream goes through
    here, on the relay path. Anything else goes to `stripped_json`."""
    if obj.__class__ is not dict:
        return None
    choices = obj.get("choices")
    if choices.__class__ is not list or len(choices) != 1 or choices[0].__class__ is not dict:
        try:
            return stripped_json(kind, obj, strip)
        except (TypeError, AttributeError):  # e.g. "choices": 7: relayed as it came, the others stripped
            return None
    ch = choices[0]
    pt = obj.get("prompt_token_ids") if tids else None
    ti = ch.get("token_ids") if tids else None
    cp = ch.get("prompt_token_ids") if tids and kind == COMPLETIONS else None
    lp = ch.get("logprobs") if drop else None
    if pt is None and ti is None and lp is None and cp is None:
        return None
    if pt is not None:
        obj["prompt_token_ids"] = None
    if ti is not None:
        ch["token_ids"] = None
    if cp is not None:
        ch["prompt_token_ids"] = None
    if lp is not None:
        ch["logprobs"] = None
    try:
        return _dumps(obj)
    finally:
        if pt is not None:
            obj["prompt_token_ids"] = pt
        if ti is not None:
            ch["token_ids"] = ti
        if cp is not None:
            ch["prompt_token_ids"] = cp
        if lp is not None:
            ch["logprobs"] = lp


def strip_stream(kind: str | None, data: bytes, strip: dict[str, Any]) -> tuple[bytes, list[Any], int]:
    """Strip complete SSE events (as the core's splitter cuts them).

    Returns (bytes to relay, the parsed data of each event that has data other than
    ``[DONE]``: the upstream's object, unstripped, or None when not JSON, events changed).
    Events are parsed once here and the recorder reuses the objects."""
    changed = 0
    parsed: list[Any] = []
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    tids = bool(strip.get("token_ids"))
    drop = strip.get("logprobs") == "drop"
    if b"\r" in data:
        parts = []
        for ev in SSEParser().feed(data):
            if ev.data is not None and not ev.done:
                obj = ev.json
                parsed.append(obj)
                new = _stripped_event(kind, obj, strip, tids, drop)
                if new is not None:
                    head = f"event: {ev.event}\n".encode() if ev.event is not None else b""
                    parts.append(head + b"data: " + new + b"\n\n")
                    changed += 1
                    continue
            parts.append(ev.raw)
        return (b"".join(parts) if changed else data), parsed, changed
    blocks = data.split(b"\n\n")  # the events without their blank line, then what follows the last
    append = parsed.append
    payload: bytes | None
    for n in range(len(blocks) - 1):
        block = blocks[n]
        if block[:6] == b"data: " and b"\n" not in block:
            payload = block[6:]
            name = None
        elif not block:
            continue
        else:
            payload, name = _parse_block(block)
            if payload is None:
                continue
        if payload == b"[DONE]":
            continue
        try:
            obj = loads(payload) if payload else None
        except decode_error:
            obj = None
        append(obj)
        new = _stripped_event(kind, obj, strip, tids, drop)
        if new is not None:
            blocks[n] = (b"data: " + new) if name is None else (f"event: {name}\ndata: ".encode() + new)
            changed += 1
    return (b"\n\n".join(blocks) if changed else data), parsed, changed


# -- the fast path: cutting the injected values out of vLLM's bytes ------------------------------

_LOGPROBS = b',"logprobs":{'
_TOKEN_IDS = b'token_ids":['  # "token_ids" (choice) and "prompt_token_ids" (event)
_ID_CHARS = b"0123456789,"


def splice_chat_run(data: bytes, events: list[ChatEvent], tids: bool, drop: bool) -> tuple[bytes, int] | None:
    """``data`` (a run of chat events, ``events`` its decoding) with the injected values
    replaced by ``null`` in place: (bytes to relay, events changed), or None when a value is not
    where vLLM writes it (the caller then strips event by event).

    Why a value cut this way is the right one: JSON text never has an unescaped quote inside a
    string, so ``,"logprobs":{`` and ``token_ids":[`` only match keys; in vLLM's chat events only
    the choice has ``logprobs`` and ``token_ids`` and only the event has ``prompt_token_ids``.
    Each logprobs value cut is the very bytes the decoder delimited for the next choice in
    document order (`ChatChoice.logprobs` is raw JSON), so the cut ends exactly where that
    value ends; a token-id list holds digits and commas only, so it ends at its first ``]``.
    Token-id lists are looked for between the logprobs values only (a logprobs value is cut
    whole, whatever it holds), so the text is searched once. The number of values found must
    equal the number the decoded events hold, so nothing set is left in and nothing else is cut."""
    want_ids = changed = 0
    logprobs: list[Any] = []
    for ev in events:
        before = len(logprobs) + want_ids
        if tids and ev.prompt_token_ids is not None:
            want_ids += 1
        for ch in ev.choices or ():
            if drop and ch.logprobs != NULL:
                logprobs.append(ch.logprobs)
            if tids and ch.token_ids is not None:
                want_ids += 1
        if len(logprobs) + want_ids != before:
            changed += 1
    if not changed:
        return data, 0
    find = data.find
    parts: list[bytes] = []
    pos = 0  # data[:pos] is in parts
    found = 0
    values = iter(logprobs)
    while True:
        value = next(values, None)
        if value is None:
            stop = len(data)
        else:
            stop = find(_LOGPROBS, pos)
            if stop < 0:
                return None
        if want_ids:  # token-id lists in data[pos:stop]
            i = find(_TOKEN_IDS, pos, stop)
            while i >= 0:
                start = i + 11  # the value's "["
                end = find(b"]", start, stop)
                if end < 0 or data[start + 1:end].translate(None, _ID_CHARS):
                    return None
                parts.append(data[pos:start])
                parts.append(b"null")
                pos = end + 1
                found += 1
                i = find(_TOKEN_IDS, pos, stop)
        if value is None:
            break
        start = stop + 12  # the value's "{"
        if not data.startswith(value, start):
            return None
        parts.append(data[pos:start])
        parts.append(b"null")
        pos = start + len(value)
    if found != want_ids or (logprobs and find(_LOGPROBS, pos) >= 0):
        return None
    parts.append(data[pos:])
    return b"".join(parts), changed
