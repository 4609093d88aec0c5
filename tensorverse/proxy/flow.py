"""A flow is one request through the proxy and its response; addons see flows through hooks.

The proxy core (`tensorverse.proxy.core`) knows nothing of recording, sessions or shadows: those
are addons, in the manner of mitmproxy. The core calls, in this order:

``request(flow)`` (async, before the request is forwarded; may rewrite ``flow.upstream_body``)
``request_forwarded(flow)`` (sync, once the request is on its way to the upstream and its answer
    is awaited, or once it is known that it will not get there: work that must see every request
    but need not delay it, such as grouping it into a session)
    ``response_start(flow)`` (status and headers are known)
    for each run of complete SSE events that arrives (one read from the upstream):
        ``stream_rewrite(flow, data)`` (sync, before the relay; returns the bytes to relay in
        place of ``data``: stripping of injected fields),
        ``event(flow, ev)`` for each event, in order (sync; may change ``ev``; only for addons
        that override it: the core then parses the events, which the fast path avoids),
        the bytes are written to the client, then
        ``stream_data(flow, data, t)`` (sync, after the relay: the upstream's own bytes and the
        time they arrived; the recorder keeps them and parses them later, off the relay path)
    or ``response_body(flow)`` for a whole JSON body (sync; may replace ``flow.response_body``)
``response_done(flow)`` or ``error(flow)`` (async, in the background, after the client has the
    last byte: nothing done there can slow or break the agent)

Only flows of LLM endpoints (``flow.kind`` set) reach the addons; everything else is relayed
as bytes. Hooks must not raise: the core catches, logs and counts whatever they do raise.

What one addon hands to the next travels in typed attributes of the flow, grouped under the addon
that writes them (``flow.turn_kind`` from the session grouping, ``flow.turn`` and
``flow.turn_future`` from the recorder, ...), never in a free-form dict; ``flow.meta`` is left to
third-party addons. An addon that hands something new on adds its attribute here.
"""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import orjson
from multidict import CIMultiDictProxy

from tensorverse.proxy.sse import SSEEvent
from tensorverse.store.records import Session, Turn

_ids = itertools.count(1)
_prefix = os.urandom(3).hex()

# Turn states (stored with the turn).
PENDING = "pending"
OK = "ok"  # the upstream answered 2xx and the client received all of it
UPSTREAM_ERROR = "upstream_error"  # the upstream answered 4xx/5xx (relayed as such)
ABORTED = "aborted"  # the client went away before the end; the upstream request was cancelled
ERROR = "error"  # the proxy could not complete the exchange (upstream down, cut, timed out)


def _unset() -> Any:
    return _UNSET


_UNSET: Any = object()


@dataclass(eq=False)
class Flow:
    method: str
    path: str  # as the client sent it (without the query)
    query: str
    headers: CIMultiDictProxy[str]  # the client's request headers
    body: bytes  # the client's request body, unchanged
    kind: str | None = None  # endpoint kind (tensorverse.proxy.protocol), None = plain relay
    id: str = field(default_factory=lambda: f"{_prefix}{next(_ids):08x}")
    start_ns: int = field(default_factory=time.time_ns)
    t0: float = field(default_factory=time.perf_counter)

    # What goes to the upstream; addons may replace it in `request` (the core sends it).
    upstream_body: bytes = b""
    # Parameters the proxy added to the upstream request (name -> value), for stripping/recording.
    injected: dict[str, Any] = field(default_factory=dict)

    # Response
    status: int | None = None
    response_headers: CIMultiDictProxy[str] | None = None
    response_body: bytes | None = None  # whole bodies only (non-streaming JSON)
    stream: bool = False  # the response is text/event-stream
    sse_tail: bytes = b""  # bytes after the last complete event (a stream cut mid-event)

    # Timings (perf_counter seconds, relative to t0 via the properties below)
    t_headers: float | None = None
    t_first_event: float | None = None
    t_first_token: float | None = None
    t_last_event: float | None = None  # arrival of the last complete events of a stream
    t_end: float | None = None

    state: str = PENDING
    error: str | None = None
    retried_without_injection: bool = False

    # Sessions
    session_id: str | None = None
    turn_index: int | None = None
    session_is_new: bool = False

    # The core: what the upstream answered when it refused the body the addons changed (the
    # client's own body was then sent: ``retried_without_injection``)
    upstream_rejection: str | None = None

    # State an addon hands to the addons after it, one typed attribute each (mitmproxy's flow
    # attributes), named by the addon that writes it.
    # Injector: the response fields to strip (the client did not ask for them), and a stream
    # chunk's events it parsed already (``(chunk, events)``: the recorder reuses them)
    strip: dict[str, Any] | None = None
    parsed_events: tuple[bytes, list[Any]] | None = None
    # RequestMetrics: perf_counter of the upstream send and of the upstream's last byte
    t_upstream_send: float | None = None
    t_upstream_last: float | None = None
    # Sessions: main or side turn and the evidence that grouped it; a new session's record, stored
    # once the turn is over; the conversation's messages, history and chain tip for the next turn;
    # the session a stored side turn was linked to later; the turn is over (the recorder stores it)
    turn_kind: str = "main"
    grouping: dict[str, Any] | None = None
    session_record: Session | None = None
    messages: list[Any] | None = None
    history: Any = None
    chain_tip: bytes | None = None  # the hash chain of the request's messages (proxy/sessions.py)
    linked_to: str | None = None
    recorded: bool = False
    # Recorder: the answer's accumulator, whether it was settled, events it could not parse, the
    # turn record it stored and the store's future for it (the shadow tee waits on it)
    acc: Any = None
    settled: bool = False
    unparsed_events: int = 0
    turn: Turn | None = None  # the recorder's (`tensorverse.proxy.recorder`)
    turn_future: Future | None = None

    # Free-form state of third-party addons (addon name -> anything); Tensorverse's own addons
    # use the typed attributes above
    meta: dict[str, Any] = field(default_factory=dict)
    forwarded: bool = False  # the `request_forwarded` hooks have run

    _json: Any = field(default_factory=_unset, repr=False)
    _json_error: str | None = field(default=None, repr=False)
    _response_json: Any = field(default_factory=_unset, repr=False)

    def __post_init__(self) -> None:
        if not self.upstream_body:
            self.upstream_body = self.body

    # -- request body ------------------------------------------------------------------------
    @property
    def request_json(self) -> Any:
        """The client's body parsed as JSON, or None (see `request_parse_error`)."""
        if self._json is _UNSET:
            try:
                self._json = orjson.loads(self.body) if self.body else None
                if self._json is None and self.body:
                    self._json_error = "body is JSON null"
                elif not self.body:
                    self._json_error = "empty body"
            except orjson.JSONDecodeError as e:
                self._json = None
                self._json_error = f"invalid JSON: {e}"
        return self._json

    @property
    def request_parse_error(self) -> str | None:
        _ = self.request_json
        return self._json_error

    @property
    def client_wants_stream(self) -> bool:
        j = self.request_json
        return isinstance(j, dict) and bool(j.get("stream"))

    # -- response body -----------------------------------------------------------------------
    @property
    def response_json(self) -> Any:
        if self._response_json is _UNSET:
            try:
                self._response_json = orjson.loads(self.response_body) if self.response_body else None
            except orjson.JSONDecodeError:
                self._response_json = None
        return self._response_json

    def set_response_json(self, value: Any) -> None:
        self._response_json = value
        self.response_body = orjson.dumps(value)

    # -- timings (milliseconds from the request's arrival) -------------------------------------
    def _ms(self, t: float | None) -> float | None:
        return None if t is None else round((t - self.t0) * 1000.0, 3)

    def timings(self) -> dict[str, float | None]:
        return {
            "ttfb_ms": self._ms(self.t_headers),
            "ttft_ms": self._ms(self.t_first_token if self.t_first_token is not None else
                                (self.t_end if not self.stream else None)),
            "first_event_ms": self._ms(self.t_first_event),
            "total_ms": self._ms(self.t_end),
        }


class Addon:
    """Base class of proxy features. Override the hooks you need (see the module docstring)."""

    name = "addon"

    async def start(self) -> None:
        """Called once when the proxy starts (inside its event loop)."""

    async def stop(self) -> None:
        """Called once when the proxy stops."""

    async def request(self, flow: Flow) -> None:
        pass

    def request_forwarded(self, flow: Flow) -> None:
        pass

    def response_start(self, flow: Flow) -> None:
        pass

    def stream_rewrite(self, flow: Flow, data: bytes) -> bytes:
        return data

    def event(self, flow: Flow, ev: SSEEvent) -> None:
        pass

    def stream_data(self, flow: Flow, data: bytes, t: float) -> None:
        pass

    def response_body(self, flow: Flow) -> None:
        pass

    async def response_done(self, flow: Flow) -> None:
        pass

    async def error(self, flow: Flow) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        """Counters for /stats (JSON-serialisable)."""
        return {}


def overrides(addon: Addon, hook: str) -> bool:
    return getattr(type(addon), hook) is not getattr(Addon, hook)


def worth_logging(n: int) -> bool:
    """Whether the ``n``-th occurrence of a repeated warning is logged: 1st, 10th, 100th, then
    every 1000th; a full store or queue at production rates must not flood the log."""
    return n in (1, 10, 100) or n % 1000 == 0

