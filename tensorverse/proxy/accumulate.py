"""Accumulators: they turn a response (one JSON body, or the stream's events) into the recorded
form of its choices: text, reasoning, tool calls, token ids, logprobs, finish reason, usage
(`ChatAccumulator`, `CompletionAccumulator`, `MessagesAccumulator`; `ACCUMULATORS` by endpoint).

The shapes are vLLM's (0.32): ``vllm/entrypoints/openai/*/protocol.py`` and
``vllm/entrypoints/anthropic/protocol.py``.
"""

from __future__ import annotations

from typing import Any

import orjson
from msgspec import UNSET, Raw

from tensorverse.jsonbytes import RawJSON
from tensorverse.proxy.events import NULL, ChatEvent, decode_chat_run
from tensorverse.proxy.protocol import CHAT, COMPLETIONS, MESSAGES
from tensorverse.proxy.sse import _parse_events
from tensorverse.store.turns import UPSTREAM_LOGPROBS, chat_logprobs, logprobs_values, token_key


# -- logprobs (the canonical shape: `tensorverse.store.turns`) ---------------------------------


def _completion_logprobs(lp: dict | None) -> list[dict]:
    if not isinstance(lp, dict):
        return []
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    out = []
    for i, tok in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        out.append(
            {
                "token": token_key(str(tok)),
                "logprob": values[i] if i < len(values) else None,
                "top": [[token_key(str(k)), v] for k, v in top.items()],
            }
        )
    return out


# -- accumulators -----------------------------------------------------------------------------


class _Choice:
    __slots__ = ("index", "text", "reasoning", "tool_calls", "token_ids", "logprobs", "raw_chat_logprobs", "finish_reason",
                 "stop_reason", "role")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict] = {}
        self.token_ids: list[int] | None = None
        self.logprobs: list[dict] = []
        self.raw_chat_logprobs: list[Any] = []  # content lists, or raw logprobs values (`record`)
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.role: str | None = None

    def add_token_ids(self, ids: Any) -> None:
        if isinstance(ids, list):
            if self.token_ids is None:
                self.token_ids = []
            self.token_ids.extend(ids)

    def add_tool_delta(self, tc: dict, position: int) -> None:
        idx = tc.get("index", position)
        if not isinstance(idx, int):
            idx = position
        slot = self.tool_calls.setdefault(idx, {"id": None, "type": "function", "name": "", "arguments": ""})
        if tc.get("id"):
            slot["id"] = tc["id"]
        if tc.get("type"):
            slot["type"] = tc["type"]
        fn = tc.get("function") or {}
        if isinstance(fn, dict):
            if fn.get("name"):
                slot["name"] += fn["name"]
            args = fn.get("arguments")
            if isinstance(args, str):
                slot["arguments"] += args
            elif args is not None:
                slot["arguments"] += orjson.dumps(args).decode()

    def _logprobs(self) -> list[dict]:
        """The canonical logprobs of what was folded in (dicts, and raw values decoded now)."""
        for content in self.raw_chat_logprobs:
            if content.__class__ is Raw:
                self.logprobs.extend(logprobs_values([orjson.loads(bytes(content))]))
            else:
                self.logprobs.extend(chat_logprobs(content))
        self.raw_chat_logprobs = []
        return self.logprobs

    def record(self) -> dict:
        calls = [self.tool_calls[k] for k in sorted(self.tool_calls)]
        record = {
            "index": self.index,
            "text": "".join(self.text),
            "reasoning": "".join(self.reasoning) or None,
            "tool_calls": [
                {"id": c["id"], "type": c["type"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls
            ],
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "token_ids": self.token_ids,
            "logprobs": None,
        }
        raws = self.raw_chat_logprobs
        if raws and not self.logprobs and all(r.__class__ is Raw for r in raws):
            # vLLM's chat stream: kept as received, converted when read (`tensorverse.store.turns`)
            record[UPSTREAM_LOGPROBS] = RawJSON(b"[" + b",".join(raws) + b"]")
        else:
            record["logprobs"] = self._logprobs() or None
        return record


class Accumulator:
    """Builds the recorded response from a JSON body (`add_body`) or stream events (`add_event`)."""

    kind = ""

    def __init__(self) -> None:
        self.choices: dict[int, _Choice] = {}
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict | None = None
        self.response_id: str | None = None
        self.model: str | None = None
        self.events = 0
        self.first_token_seen = False  # set by add_event when an event carries output
        # Raw stream bytes not parsed yet (`feed_raw`), with their arrival times.
        self._raw: list[bytes | list[Any]] = []
        self._raw_t: list[float] = []
        self.raw_bytes = 0
        self.first_token_t: float | None = None  # arrival of the first event that carried output
        self.unparsed_events = 0  # events whose data is not JSON
        self.stream_error: Any = None  # vLLM's mid-stream error event ({"error": ...}), if one came
        self._result: dict | None = None

    def feed_raw(self, data: bytes, t: float, parsed: list[Any] | None = None) -> None:
        """Keep complete events (bytes, as relayed from the upstream; or ``parsed``, their data
        already parsed: None for data that is not JSON) to fold in later (`flush`)."""
        self._raw.append(data if parsed is None else parsed)
        self._raw_t.append(t)
        self.raw_bytes += len(data)
        self._result = None

    def flush(self) -> None:
        """Parse and fold in the events given to `feed_raw`."""
        if not self._raw:
            return
        chunks, times = self._raw, self._raw_t
        self._raw, self._raw_t, self.raw_bytes = [], [], 0
        for chunk, t in zip(chunks, times):
            if self.fold_run(self.decode_run(chunk) if isinstance(chunk, bytes) else chunk) and self.first_token_t is None:
                self.first_token_t = t

    def decode_run(self, data: bytes) -> list[Any]:
        """The events of a run of complete events (see `_parse_events`)."""
        return _parse_events(data)

    def fold_run(self, events: list[Any]) -> bool:
        """Fold in the parsed data of a run of events; True when one of them carried output.
        An event that cannot be folded (JSON, but not of the API's shape) counts as unparsed:
        it never costs the turn its other events."""
        output = False
        add = self.add_event
        for obj in events:
            if obj is None:
                self.unparsed_events += 1
            elif type(obj) is dict and "error" in obj and "choices" not in obj and "delta" not in obj:
                self.stream_error = obj["error"]
            else:
                try:
                    if add(obj):
                        output = True
                except (TypeError, AttributeError, ValueError):
                    self.unparsed_events += 1
        return output

    def choice(self, index: Any) -> _Choice:
        if not isinstance(index, int):
            index = 0
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = _Choice(index)
        return c

    def add_body(self, body: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def add_event(self, obj: Any) -> bool:  # pragma: no cover - overridden
        """Fold one parsed stream event in; True when it carried output (text, tokens, tools)."""
        raise NotImplementedError

    def _head(self, obj: dict) -> None:
        self._head_values(obj.get("id"), obj.get("model"), obj.get("usage"))

    def _head_values(self, response_id: Any, model: Any, usage: Any) -> None:
        if self.response_id is None and isinstance(response_id, str):
            self.response_id = response_id
        if self.model is None and isinstance(model, str):
            self.model = model
        if isinstance(usage, dict):
            self.usage = usage

    def result(self) -> dict:
        """The recorded response (computed once; `add_*`/`feed_raw` afterwards recompute it)."""
        self.flush()
        if self._result is None:
            self._result = self._compute()
        return self._result

    def _compute(self) -> dict:
        choices = [self.choices[k].record() for k in sorted(self.choices)]
        first = choices[0] if choices else None
        return {
            "response_id": self.response_id,
            "model": self.model,
            "prompt_token_ids": self.prompt_token_ids,
            "choices": choices,
            "output_token_ids": first["token_ids"] if first else None,
            "text": first["text"] if first else None,
            "reasoning": first["reasoning"] if first else None,
            "tool_calls": first["tool_calls"] if first else [],
            "finish_reason": first["finish_reason"] if first else None,
            "usage": self.usage,
        }


class ChatAccumulator(Accumulator):
    kind = CHAT

    def add_body(self, body: Any) -> None:
        self._result = None
        if not isinstance(body, dict):
            return
        self._head(body)
        if isinstance(body.get("prompt_token_ids"), list):
            self.prompt_token_ids = body["prompt_token_ids"]
        for ch in _list(body.get("choices")):
            if not isinstance(ch, dict):
                continue
            c = self.choice(ch.get("index", 0))
            msg = ch.get("message") or {}
            if isinstance(msg, dict):
                c.role = msg.get("role")
                if isinstance(msg.get("content"), str):
                    c.text.append(msg["content"])
                r = msg.get("reasoning_content") or msg.get("reasoning")
                if isinstance(r, str):
                    c.reasoning.append(r)
                for i, tc in enumerate(msg.get("tool_calls") or ()):
                    if isinstance(tc, dict):
                        c.add_tool_delta({**tc, "index": i}, i)
            c.add_token_ids(ch.get("token_ids"))
            lp = ch.get("logprobs")
            if isinstance(lp, dict):
                c.logprobs.extend(chat_logprobs(lp.get("content")))
            c.finish_reason = ch.get("finish_reason")
            c.stop_reason = ch.get("stop_reason")

    def add_event(self, obj: Any) -> bool:
        self._result = None
        if not isinstance(obj, dict):
            return False
        self.events += 1
        get = obj.get
        if self.response_id is None or self.model is None:
            self._head(obj)
        elif get("usage").__class__ is dict:  # what _head does once id and model are known
            self.usage = obj["usage"]
        pt = get("prompt_token_ids")
        if isinstance(pt, list):
            self.prompt_token_ids = pt
        output = False
        choices = self.choices
        for ch in _list(get("choices")):
            if not isinstance(ch, dict):
                continue
            cget = ch.get
            index = cget("index", 0)
            c = choices.get(index) if index.__class__ is int else None
            if c is None:
                c = self.choice(index)
            delta = cget("delta") or {}
            if delta and isinstance(delta, dict) and _fold_delta(
                    c, delta.get("role"), delta.get("content"),
                    delta.get("reasoning_content") or delta.get("reasoning"), delta.get("tool_calls")):
                output = True
            if _fold_ids(c, cget("token_ids")):
                output = True
            lp = cget("logprobs")
            if lp and isinstance(lp, dict) and lp.get("content"):
                c.raw_chat_logprobs.append(lp["content"])
            fr = cget("finish_reason")
            if fr is not None:
                c.finish_reason = fr
                c.stop_reason = cget("stop_reason")
        return output

    def decode_run(self, data: bytes) -> list[Any]:
        events = decode_chat_run(data)
        return _parse_events(data) if events is None else events

    def fold_run(self, events: list[Any]) -> bool:
        if not events or events[0].__class__ is not ChatEvent:
            return super().fold_run(events)
        # `add_event` for the fast path's structs (`tensorverse.proxy.events`), which are of
        # vLLM's shape by construction; tests/proxy/test_fastpath.py holds the two paths equal.
        output = False
        choices = self.choices
        self._result = None
        for ev in events:
            if ev.error is not UNSET and ev.is_error:
                self.stream_error = ev.error
                continue
            self.events += 1
            try:
                if self.response_id is None or self.model is None:
                    self._head_values(ev.id, ev.model, ev.usage)
                elif ev.usage.__class__ is dict:
                    self.usage = ev.usage
                if isinstance(ev.prompt_token_ids, list):
                    self.prompt_token_ids = ev.prompt_token_ids
                for ch in ev.choices or ():
                    index = ch.index
                    c = choices.get(index) if index.__class__ is int else None
                    if c is None:
                        c = self.choice(index)
                    delta = ch.delta
                    if delta is not None:
                        content = delta.content
                        if content.__class__ is str and delta.tool_calls is None and delta.role is None \
                                and delta.reasoning_content is None and delta.reasoning is None:
                            if content:  # the common delta: text only
                                c.text.append(content)
                                output = True
                        elif _fold_delta(c, delta.role, content, delta.reasoning_content or delta.reasoning,
                                         delta.tool_calls):
                            output = True
                    if _fold_ids(c, ch.token_ids):
                        output = True
                    if ch.logprobs != NULL:  # raw JSON, kept as it is (`_Choice.record`)
                        c.raw_chat_logprobs.append(ch.logprobs)
                    if ch.finish_reason is not None:
                        c.finish_reason = ch.finish_reason
                        c.stop_reason = ch.stop_reason
            except (TypeError, AttributeError, ValueError):  # as `Accumulator.fold_run`
                self.unparsed_events += 1
        return output


def _list(value: Any) -> list | tuple:
    """``value`` when it is a list (``choices``), else nothing to iterate."""
    return value if value.__class__ is list else ()


def _fold_delta(c: _Choice, role: Any, content: Any, reasoning: Any, tool_calls: Any) -> bool:
    """Fold a chat stream delta's values into its choice (a dict's, or the fast path's
    `ChatDelta`'s); True when it carried output."""
    output = False
    if role:
        c.role = role
    if content and isinstance(content, str):
        c.text.append(content)
        output = True
    if reasoning and isinstance(reasoning, str):
        c.reasoning.append(reasoning)
        output = True
    if tool_calls:
        for i, tc in enumerate(tool_calls):
            if isinstance(tc, dict):
                c.add_tool_delta(tc, i)
                output = True
    return output


def _fold_ids(c: _Choice, ids: Any) -> bool:
    """Fold a stream choice's ``token_ids`` in; True when there were some (output)."""
    if ids:
        if isinstance(ids, list):
            if c.token_ids is None:
                c.token_ids = []
            c.token_ids.extend(ids)
        return True
    if c.token_ids is None and isinstance(ids, list):
        c.token_ids = []
    return False


class CompletionAccumulator(Accumulator):
    kind = COMPLETIONS

    def _fold(self, ch: dict) -> bool:
        c = self.choice(ch.get("index", 0))
        text = ch.get("text")
        output = False
        if isinstance(text, str) and text:
            c.text.append(text)
            output = True
        ids = ch.get("token_ids")
        if ids:
            output = True
        c.add_token_ids(ids)
        if isinstance(ch.get("prompt_token_ids"), list) and self.prompt_token_ids is None:
            self.prompt_token_ids = ch["prompt_token_ids"]
        c.logprobs.extend(_completion_logprobs(ch.get("logprobs")))
        if ch.get("finish_reason") is not None:
            c.finish_reason = ch["finish_reason"]
            c.stop_reason = ch.get("stop_reason")
        return output

    def add_body(self, body: Any) -> None:
        self._result = None
        if not isinstance(body, dict):
            return
        self._head(body)
        for ch in _list(body.get("choices")):
            if isinstance(ch, dict):
                self._fold(ch)

    def add_event(self, obj: Any) -> bool:
        self._result = None
        if not isinstance(obj, dict):
            return False
        self.events += 1
        self._head(obj)
        output = False
        for ch in _list(obj.get("choices")):
            if isinstance(ch, dict):
                output = self._fold(ch) or output
        return output


class MessagesAccumulator(Accumulator):
    """Anthropic Messages (vLLM's /v1/messages): content blocks, stop_reason, usage."""

    kind = MESSAGES

    def __init__(self) -> None:
        super().__init__()
        self._blocks: dict[int, dict] = {}

    def _block(self, index: Any, block: dict | None = None) -> dict:
        if not isinstance(index, int):
            index = len(self._blocks)
        b = self._blocks.get(index)
        if b is None:
            b = self._blocks[index] = {"type": "text", "text": "", "thinking": "", "id": None, "name": "", "json": ""}
        if isinstance(block, dict):
            b["type"] = block.get("type", b["type"])
            if block.get("type") == "tool_use":
                b["id"] = block.get("id")
                b["name"] = block.get("name") or ""
                inp = block.get("input")
                if inp not in (None, {}):
                    b["json"] = orjson.dumps(inp).decode()
            elif isinstance(block.get("text"), str):
                b["text"] += block["text"]
            elif isinstance(block.get("thinking"), str):
                b["thinking"] += block["thinking"]
        return b

    def _usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.usage = {**(self.usage or {}), **usage}

    def add_body(self, body: Any) -> None:
        self._result = None
        if not isinstance(body, dict):
            return
        if isinstance(body.get("id"), str):
            self.response_id = body["id"]
        if isinstance(body.get("model"), str):
            self.model = body["model"]
        self._usage(body.get("usage"))
        for i, block in enumerate(body.get("content") or ()):
            if isinstance(block, dict):
                self._block(i, block)
        c = self.choice(0)
        c.finish_reason = body.get("stop_reason")
        c.stop_reason = body.get("stop_sequence")

    def add_event(self, obj: Any) -> bool:
        self._result = None
        if not isinstance(obj, dict):
            return False
        self.events += 1
        t = obj.get("type")
        output = False
        if t == "message_start" and isinstance(obj.get("message"), dict):
            m = obj["message"]
            self.response_id = m.get("id")
            self.model = m.get("model")
            self._usage(m.get("usage"))
        elif t == "content_block_start":
            self._block(obj.get("index"), obj.get("content_block"))
        elif t == "content_block_delta":
            b = self._block(obj.get("index"))
            d = obj.get("delta") or {}
            dt = d.get("type")
            if dt == "text_delta" and isinstance(d.get("text"), str):
                b["text"] += d["text"]
                output = bool(d["text"])
            elif dt == "input_json_delta" and isinstance(d.get("partial_json"), str):
                b["json"] += d["partial_json"]
                output = True
            elif dt == "thinking_delta" and isinstance(d.get("thinking"), str):
                b["thinking"] += d["thinking"]
                output = bool(d["thinking"])
        elif t == "message_delta":
            d = obj.get("delta") or {}
            c = self.choice(0)
            if d.get("stop_reason") is not None:
                c.finish_reason = d["stop_reason"]
            c.stop_reason = d.get("stop_sequence")
            self._usage(obj.get("usage"))
        return output

    def _compute(self) -> dict:
        c = self.choice(0)
        c.text = []
        c.reasoning = []
        c.tool_calls = {}
        for i in sorted(self._blocks):
            b = self._blocks[i]
            if b["type"] == "tool_use":
                c.tool_calls[i] = {"id": b["id"], "type": "function", "name": b["name"], "arguments": b["json"] or "{}"}
            elif b["type"] == "thinking":
                c.reasoning.append(b["thinking"])
            else:
                c.text.append(b["text"])
        return super()._compute()


ACCUMULATORS: dict[str, type[Accumulator]] = {
    CHAT: ChatAccumulator,
    COMPLETIONS: CompletionAccumulator,
    MESSAGES: MessagesAccumulator,
}
