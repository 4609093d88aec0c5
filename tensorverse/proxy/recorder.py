"""The recorder: one turn record per LLM request, written to the store.

A turn holds the client's request (without credentials or cookies), what the proxy injected,
the primary's prompt and output token ids, top-k logprobs, text, reasoning, tool calls, finish
reason, usage, status, state (``ok``, ``upstream_error``, ``aborted``, ``error``) and timings
(TTFB, TTFT, total). A body that is not JSON is recorded as unparsed text (truncated), never
dropped. Store writes are submitted to the store's writer thread and never awaited on the
request path; a full store (`StoreFullError`) is counted and proxying goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from tensorverse.proxy.flow import OK, UPSTREAM_ERROR, Addon, Flow, worth_logging
from tensorverse.proxy.accumulate import ACCUMULATORS
from tensorverse.store.records import Turn

log = logging.getLogger("tensorverse.proxy.recorder")

DEFAULT_REDACTED = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key"})


def _text(raw: bytes | None, limit: int) -> str | None:
    if raw is None:
        return None
    return raw[:limit].decode("utf-8", "replace")


class Recorder(Addon):
    name = "recorder"

    def __init__(
        self,
        store: Any = None,
        *,
        primary: str = "primary",
        redacted_headers: frozenset[str] | set[str] = DEFAULT_REDACTED,
        max_unparsed_bytes: int = 64 << 10,
    ) -> None:
        self.store = store
        self.primary = primary
        self.redacted = frozenset(h.lower() for h in redacted_headers) | DEFAULT_REDACTED
        self.max_unparsed_bytes = max_unparsed_bytes
        self.counters = {"recorded": 0, "store_full": 0, "store_errors": 0, "unparsed_requests": 0,
                         "unparsed_events": 0}

    def stats(self) -> dict[str, Any]:
        return dict(self.counters)

    # -- accumulation ----------------------------------------------------------------------------
    # A stream's events are kept as the upstream's bytes (after they were relayed) and parsed
    # once the client has the whole response (`response_done`, in the background), or every
    # FLUSH_BYTES for a long stream, so nothing of recording sits between an event and the client.
    FLUSH_BYTES = 256 << 10

    def response_start(self, flow: Flow) -> None:
        if (flow.status or 500) < 400:
            flow.acc = ACCUMULATORS[flow.kind]()  # type: ignore[index]

    def stream_data(self, flow: Flow, data: bytes, t: float) -> None:
        acc = flow.acc
        if acc is not None:
            parsed, flow.parsed_events = flow.parsed_events, None  # the injector parsed these events already
            acc.feed_raw(data, t, parsed[1] if parsed is not None and parsed[0] is data else None)
            if acc.raw_bytes > self.FLUSH_BYTES:
                acc.flush()

    def _settle(self, flow: Flow) -> None:
        """Parse what is left of a stream; first-token time and unparsed events from it."""
        acc = flow.acc
        if acc is None or flow.settled:
            return
        flow.settled = True
        acc.flush()
        if flow.t_first_token is None and acc.first_token_t is not None:
            flow.t_first_token = acc.first_token_t
        if acc.unparsed_events:
            self.counters["unparsed_events"] += acc.unparsed_events
            flow.unparsed_events = acc.unparsed_events
        if acc.stream_error is not None and flow.state == OK:
            # vLLM reports an engine failure inside a 200 stream ({"error": ...}, then [DONE]):
            # the output is partial, so the turn is an upstream error (and is not shadowed).
            err = acc.stream_error
            msg = err.get("message") if isinstance(err, dict) else err
            flow.state = UPSTREAM_ERROR
            flow.error = f"upstream error event mid-stream: {msg}"

    def response_body(self, flow: Flow) -> None:
        acc = flow.acc
        if acc is not None:
            acc.add_body(flow.response_json)

    # -- the record ----------------------------------------------------------------------------
    def headers(self, flow: Flow) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, value in flow.headers.items():
            low = name.lower()
            if low in self.redacted:
                continue
            out[low] = f"{out[low]}, {value}" if low in out else value
        return out

    def build_turn(self, flow: Flow) -> Turn:
        """The flow's turn as it is stored (its fields: :class:`~tensorverse.store.records.Turn`)."""
        self._settle(flow)
        req = flow.request_json
        fields: dict[str, Any] = {
            "id": f"{flow.start_ns:016x}{flow.id}",
            "session_id": flow.session_id,
            "index": flow.turn_index if flow.turn_index is not None else 0,
            "created_ns": flow.start_ns,
            "endpoint": flow.kind,
            "method": flow.method,
            "path": flow.path,
            "backend": self.primary,
            "request_headers": self.headers(flow),
            "state": flow.state,
            "status": flow.status,
            "error": flow.error,
            "timings": flow.timings(),
            "injected": dict(flow.injected),
            "retried_without_injection": flow.retried_without_injection,
            # `main` (a turn of the conversation) or `side` (a request the agent makes beside it:
            # a title, a compaction summary, an approval judge), and why it joined its session
            "kind": flow.turn_kind,
            "grouping": flow.grouping,
        }
        if isinstance(req, dict):
            fields["request"] = req
            fields["model"] = req.get("model")
            fields["stream"] = bool(req.get("stream"))
            fields["tools_offered"] = bool(req.get("tools"))
        else:
            self.counters["unparsed_requests"] += 1
            fields["request"] = None
            fields["request_unparsed"] = True
            fields["request_parse_error"] = flow.request_parse_error
            fields["request_text"] = _text(flow.body, self.max_unparsed_bytes)
            fields["model"] = None
            fields["stream"] = False
            fields["tools_offered"] = False
        acc = flow.acc
        if acc is not None:
            fields.update(acc.result())
            fields["events"] = acc.events if flow.stream else None
            if not fields.get("model"):
                fields["model"] = acc.model
        else:
            fields.update(prompt_token_ids=None, output_token_ids=None, choices=[], text=None, reasoning=None,
                        tool_calls=[], finish_reason=None, usage=None, response_id=None)
        if flow.response_body is not None and (flow.response_json is None or (flow.status or 0) >= 400):
            fields["response_text"] = _text(flow.response_body, self.max_unparsed_bytes)
            fields["response_unparsed"] = flow.response_json is None
        if flow.unparsed_events:
            fields["unparsed_events"] = flow.unparsed_events
        if flow.sse_tail:
            fields["stream_tail"] = _text(flow.sse_tail, self.max_unparsed_bytes)
        if flow.state == OK and flow.stream and acc is not None and not any(
            c.get("finish_reason") for c in fields["choices"]
        ):
            fields["incomplete"] = True  # a stream that ended without a finish reason
        return Turn(**fields)

    async def _record(self, flow: Flow) -> None:
        self._settle(flow)
        if flow.session_id is None:
            return
        turn = self.build_turn(flow)
        flow.turn = turn
        self.counters["recorded"] += 1
        if self.store is None:
            return
        try:
            fut = self.store.put_turn(turn)
        except Exception as e:  # noqa: BLE001 - a closed/broken store never breaks proxying
            self._failed(turn, e)
            return
        flow.turn_future = fut
        fut.add_done_callback(lambda f: self._failed(turn, f.exception()) if f.exception() else None)

    def _failed(self, turn: Turn, exc: BaseException | None) -> None:
        if exc is None:
            return
        from tensorverse.store import StoreFullError

        if isinstance(exc, StoreFullError):
            self.counters["store_full"] += 1
            if worth_logging(self.counters["store_full"]):
                log.warning("store full: turn %s not recorded (%d so far)", turn.id, self.counters["store_full"])
        else:
            self.counters["store_errors"] += 1
            log.warning("turn %s not recorded: %s", turn.id, exc)

    async def response_done(self, flow: Flow) -> None:
        await self._record(flow)

    async def error(self, flow: Flow) -> None:
        await self._record(flow)
