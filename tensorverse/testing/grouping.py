"""The session grouping driven as the proxy drives it, turn by turn, for the grouping tests
(`tests/proxy/test_grouping.py`) and the session grouping benchmark (``benchmarks/session_grouping.py``).

:class:`Driver` sends chat requests through a :class:`~tensorverse.proxy.sessions.Sessions` addon:
``request_forwarded`` when the request is on its way, then, once answered, ``response_done`` with
the answer in the real chat accumulator (``flow.acc``, where the relay leaves it); with a store,
the recorder comes next in line, as in the proxy, and the turn is stored.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from tensorverse.proxy.accumulate import ACCUMULATORS
from tensorverse.proxy.flow import Flow
from tensorverse.proxy.protocol import CHAT
from tensorverse.proxy.recorder import Recorder
from tensorverse.proxy.sessions import Sessions

#: the tools a request carries unless ``tools=`` says otherwise (``None``: no tools, as in an
#: agent's side requests)
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "show", "parameters": {"type": "object"}}}]


class Driver:
    """Sends requests through a `Sessions` addon as the proxy does: `request_forwarded`, then
    (after the answer) `response_done` with the answer in the real chat accumulator. ``store``:
    the addon's store, and the recorder's after it (``None``: no store, no recorder); ``kw``: the
    addon's options. ``clock[0]`` is the addon's clock, one second further for every request."""

    def __init__(self, store: Any = None, **kw: Any) -> None:
        self.clock = [0.0]
        self.sessions = self.new_sessions(store, clock=lambda: self.clock[0], **kw)
        self.recorder = Recorder(store) if store is not None else None  # next in line, as in the proxy

    def new_sessions(self, store: Any, **kw: Any) -> Sessions:
        """The addon driven: this revision's `Sessions` (a subclass may build another)."""
        return Sessions(store, **kw)

    def start(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = TOOLS,
              headers: dict[str, str] | None = None, body_extra: dict[str, Any] | None = None) -> Flow:
        """A request forwarded: the addon has grouped it (``flow.session_id``, ``flow.turn_kind``)."""
        body = {"model": "m", "messages": messages, **({"tools": tools} if tools else {}), **(body_extra or {})}
        f = Flow("POST", "/v1/chat/completions", "", CIMultiDictProxy(CIMultiDict(headers or {})),
                 orjson.dumps(body), kind=CHAT)
        self.clock[0] += 1
        self.sessions.request_forwarded(f)
        return f

    def answer(self, f: Flow, acc: Any) -> None:
        """Hands the answer's accumulator to the flow, where the relay leaves it."""
        f.acc = acc

    def finish(self, f: Flow, answer: dict[str, Any]) -> None:
        """The request answered with ``answer`` (an assistant message): the addon's, then the
        recorder's ``response_done``; raises what the store refused."""
        f.status = 200
        acc = ACCUMULATORS[CHAT]()
        msg = {"role": "assistant", "content": answer.get("content"), "tool_calls": answer.get("tool_calls") or []}
        acc.add_body({"id": "x", "object": "chat.completion", "model": "m",
                      "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]})
        self.answer(f, acc)
        asyncio.run(self.sessions.response_done(f))
        if self.recorder is not None:
            asyncio.run(self.recorder.response_done(f))
            assert f.turn_future is not None
            f.turn_future.result(timeout=10)  # raises what the store refused

    def turn(self, messages: list[dict[str, Any]], answer: dict[str, Any], **kw: Any) -> Flow:
        """One request and its answer; ``kw``: :meth:`start`'s."""
        f = self.start(messages, **kw)
        self.finish(f, answer)
        return f
