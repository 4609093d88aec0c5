"""vLLM's chat stream events as typed structs, decoded a run of events at a time.

The relay path sees every event of every stream, and building a Python dict for each logprob
entry (with its ``bytes`` list) was the largest single cost of recording (orjson, about a
quarter of the proxy's instructions per request). msgspec decodes a whole run of complete events
in one call into these structs, which keep only what the recorder and the stripping need and
skip the rest (``object``, ``created``...) without building it. A choice's logprobs stay raw JSON
(`msgspec.Raw`, a view of the decoded bytes): the stripping cuts exactly those bytes out, and the
recorder stores them as they are (`tensorverse.store.turns`), so they are never decoded on the
proxy's event loop.

`decode_chat_run` takes a run of events exactly as `SSESplitter.feed` cuts them and returns the
decoded events, or None when the run is not in vLLM's plain form (every event one
``data: <JSON object>`` line, no ``\\r``, no comments or event names, values of the expected
types). None sends the run down the general path: one orjson parse per event, as before, so
anything unexpected is handled as it always was. Leaves (text, ids, usage, tool-call deltas)
are ``Any``: decoded as orjson decodes them, so both paths record the same values.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Raw, Struct, UnsetType

_DONE = b"data: [DONE]\n\n"

#: a choice's ``logprobs`` when it is null or absent
NULL = Raw(b"null")


class ChatDelta(Struct):
    """A choice's ``delta``: the keys the recorder folds in (the others are skipped)."""

    role: Any = None
    content: Any = None
    reasoning_content: Any = None
    reasoning: Any = None
    tool_calls: list | None = None  # anything else: the run takes the general path


class ChatChoice(Struct):
    index: Any = 0
    delta: ChatDelta | None = None
    logprobs: Raw = NULL  # the value's JSON, as the upstream wrote it
    finish_reason: Any = None
    stop_reason: Any = None
    token_ids: Any = None


class ChatEvent(Struct):
    id: Any = None
    model: Any = None
    choices: list[ChatChoice] | UnsetType = UNSET
    usage: Any = None
    prompt_token_ids: Any = None
    error: Any = UNSET
    delta: Any = UNSET

    @property
    def is_error(self) -> bool:
        """vLLM's mid-stream error event (``{"error": ...}`` without choices)."""
        return self.error is not UNSET and self.choices is UNSET and self.delta is UNSET


_decoder = msgspec.json.Decoder(list[ChatEvent])
def decode_chat_run(data: bytes) -> list[ChatEvent] | None:
    """The events of ``data`` (complete events; a final ``[DONE]`` is left out), or None when
    ``data`` is not a run of plain ``data: {...}`` events of vLLM's chat shape."""
    if data.endswith(_DONE):
        data = data[: -len(_DONE)]
        if not data:
            return []
    if data[:7] != b"data: {" or data[-2:] != b"\n\n" or b"\r" in data:
        return None
    # Events are "data: <json>\n\n"; JSON text has no raw newline, so joining the payloads with
    # commas makes one JSON array exactly when every event is one data line of one JSON value.
    payload = data[6:-2]
    body = b"[" + payload.replace(b"\n\ndata: ", b",") + b"]"
    try:
        events = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    # Each separator replaced shortened the text by 7 bytes: exactly one per event after the
    # first, and no newline left, or it was not one JSON value per event (e.g. one event
    # 'data: {...},{...}' decodes as two). `in` is a memchr; counting newlines took 10 us.
    if len(payload) + 2 - len(body) != 7 * (len(events) - 1) or b"\n" in body:
        return None
    return events
