"""Server-Sent Events as the proxy relays them: an incremental parser that keeps each event's
exact bytes (`SSEParser`), a splitter that cuts a byte stream into runs of complete events
(`SSESplitter`), and the helpers that read the events' data back."""

from __future__ import annotations

from typing import Any

import orjson


class SSEEvent:
    """One event: its exact bytes (with the blank line that ends it) and its parsed fields.

    ``raw`` is what is relayed; an addon that changes the event assigns a new ``raw``
    (see `set_json`). ``json`` parses ``data`` once, lazily (None when it is not JSON).
    """

    __slots__ = ("raw", "data", "event", "_json", "_parsed", "modified")

    def __init__(self, raw: bytes, data: bytes | None, event: str | None) -> None:
        self.raw = raw
        self.data = data
        self.event = event
        self._json: Any = None
        self._parsed = False
        self.modified = False

    @property
    def done(self) -> bool:
        return self.data == b"[DONE]"

    @property
    def json(self) -> Any:
        if not self._parsed:
            self._parsed = True
            if self.data and self.data != b"[DONE]":
                try:
                    self._json = orjson.loads(self.data)
                except orjson.JSONDecodeError:
                    self._json = None
        return self._json

    def set_json(self, value: Any) -> None:
        """Replace the event's data with ``value`` (re-serialised; other fields kept)."""
        self._json = value
        self._parsed = True
        self.data = orjson.dumps(value)
        head = f"event: {self.event}\n".encode() if self.event is not None else b""
        self.raw = head + b"data: " + self.data + b"\n\n"
        self.modified = True

    def __repr__(self) -> str:
        return f"SSEEvent(event={self.event!r}, data={self.data[:80] if self.data else None!r})"


def _parse_block(block: bytes) -> tuple[bytes | None, str | None]:
    data: list[bytes] = []
    event = None
    for line in block.splitlines():
        if not line or line[0:1] == b":":
            continue
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value.decode("utf-8", "replace")
    return (b"\n".join(data) if data else None), event


class SSEParser:
    """Incremental SSE parser. `feed` returns the complete events; partial bytes wait.

    Events end with a blank line: ``\\n\\n``, ``\\r\\n\\r\\n`` or ``\\r\\r`` (the spec allows all
    three). Bytes are kept exactly, so an unmodified event is relayed bit for bit.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf + chunk if self._buf else chunk
        events: list[SSEEvent] = []
        start = 0
        has_cr = b"\r" in buf
        while True:
            if not has_cr:
                end = buf.find(b"\n\n", start)
                if end < 0:
                    break
                stop = end + 2
            else:
                stop = _find_blank_line(buf, start)
                if stop < 0:
                    break
            raw = buf[start:stop]
            data, event = _parse_block(raw)
            events.append(SSEEvent(raw, data, event))
            start = stop
        self._buf = buf[start:]
        return events

    def tail(self) -> bytes:
        """Bytes after the last complete event (a stream cut mid-event)."""
        tail, self._buf = self._buf, b""
        return tail


class SSESplitter:
    """Cuts a byte stream at event boundaries without parsing the events: `feed` returns the
    complete events received so far (exactly those `SSEParser.feed` would return, as bytes),
    and keeps the rest for the next chunk. The relay's fast path: nothing is allocated per event.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" not in buf:
            end = buf.rfind(b"\n\n")
            if end < 0:
                self._buf = buf
                return b""
            if end > 0 and buf[end - 1] == 10:  # a run of 3+ newlines: scan as SSEParser does
                start = 0
                while True:
                    end = buf.find(b"\n\n", start)
                    if end < 0:
                        break
                    start = end + 2
                stop = start
            else:
                stop = end + 2
        else:
            stop = 0
            while True:
                nxt = _find_blank_line(buf, stop)
                if nxt < 0:
                    break
                stop = nxt
        if stop == len(buf):
            self._buf = b""
            return buf
        self._buf = buf[stop:]
        return buf[:stop]

    def tail(self) -> bytes:
        """Bytes after the last complete event (a stream cut mid-event)."""
        tail, self._buf = self._buf, b""
        return tail


def iter_event_data(data: bytes):
    """(data, event name) of each event in ``data`` (complete events, as `SSESplitter.feed`
    returns them); data is None for an event without a data field (a comment)."""
    if b"\r" in data:
        for ev in SSEParser().feed(data):
            yield ev.data, ev.event
        return
    for block in data.split(b"\n\n"):
        if block[:6] == b"data: " and b"\n" not in block:
            yield block[6:], None
        elif block:
            yield _parse_block(block)


def _parse_events(data: bytes) -> list[Any]:
    """The parsed data of each event with data (``[DONE]`` left out); None where not JSON."""
    out: list[Any] = []
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    for payload, _name in iter_event_data(data):
        if payload is None or payload == b"[DONE]":
            continue
        try:
            out.append(loads(payload) if payload else None)
        except decode_error:
            out.append(None)
    return out


def first_event_end(data: bytes) -> int:
    """Where the first event of a run of complete events (`SSESplitter.feed`) ends: the length
    of ``data`` when it holds one event, or when it is not plain ``\\n\\n``-separated SSE (the
    run then stays whole)."""
    if b"\r" in data:
        return len(data)
    end = data.find(b"\n\n")
    return len(data) if end < 0 else end + 2


def _find_blank_line(buf: bytes, start: int) -> int:
    """End offset (exclusive) of the first event terminator at or after ``start``, or -1."""
    best = -1
    for term in (b"\r\n\r\n", b"\n\n", b"\r\r", b"\n\r\n", b"\r\n\n"):
        i = buf.find(term, start)
        if i >= 0 and (best < 0 or i + len(term) < best):
            best = i + len(term)
    return best
