"""Sessions: group the turns of one agent conversation.

An agent resends the whole history every turn. A turn joins the session of an earlier turn when
its messages start with that turn's messages followed by that turn's answer (prefix match), or
when the client names the session in the ``X-Tensorverse-Session`` header. Otherwise it starts a
new session. Sessions are stored with the configured tags (agent name, environment...), merged
with ``X-Tensorverse-Tags: key=value,key=value`` from the request that created them.

Messages are compared in a canonical form that survives what agent frameworks do to a history
they resend: ``content`` null vs "" vs a list of text parts, whitespace around the text, tool
call ids, reasoning fields dropped, argument JSON re-serialised. Histories are hashed as a chain
(h_i = H(h_{i-1}, message_i)), so finding the longest known prefix costs one dict lookup per
message and memory per turn is one 16-byte key. The index is an LRU bounded in size and idle
time. Completions (``prompt`` strings) are grouped by the header only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import time
from collections import OrderedDict
from typing import Any, Callable

import orjson

from tensorverse.jsonbytes import dumps
from tensorverse.proxy.flow import Addon, Flow, worth_logging
from tensorverse.proxy.protocol import CHAT, MESSAGES

log = logging.getLogger("tensorverse.proxy.sessions")

_ID_OK = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def _canon_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return value.strip()
    try:
        return dumps(value, option=orjson.OPT_SORT_KEYS).decode()  # deep values: jsonbytes
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif p.get("type") in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
                    continue
                else:
                    parts.append(_canon_json(p))
        return "".join(parts).strip()
    return _canon_json(content)


def canonical_message(m: Any) -> bytes:
    """A message as the bytes that identify it across resends (see the module docstring)."""
    if not isinstance(m, dict):
        return orjson.dumps(["?", _canon_json(m)])
    role = m.get("role")
    if not isinstance(role, str):
        role = _canon_json(role)
    content = m.get("content")
    calls: list[tuple[str, Any]] = []
    results: list[str] = []
    for tc in m.get("tool_calls") or ():
        if isinstance(tc, dict):
            fn = tc.get("function") or {}
            calls.append((str(fn.get("name", "")), _canon_json(fn.get("arguments", ""))))
    if isinstance(content, list):  # Anthropic blocks
        for b in content:
            if isinstance(b, dict) and b.get("type") == "tool_use":
                calls.append((str(b.get("name", "")), _canon_json(b.get("input", {}))))
            elif isinstance(b, dict) and b.get("type") == "tool_result":
                results.append(_text(b.get("content")))
    if role == "tool":
        results.append(_text(content))
        text = ""
    else:
        text = _text(content)
    return orjson.dumps([role, text, calls, results])


def request_messages(kind: str | None, req: Any) -> list[Any] | None:
    """The conversation a request carries, as a list of messages (None: not a conversation)."""
    if not isinstance(req, dict):
        return None
    msgs = req.get("messages")
    if not isinstance(msgs, list):
        return None
    if kind == MESSAGES and req.get("system"):
        return [{"role": "system", "content": req["system"]}, *msgs]
    return msgs


def answer_message(result: dict | None) -> dict | None:
    """The assistant message an agent will resend for a recorded answer."""
    if not result:
        return None
    calls = [
        {"function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
        for c in result.get("tool_calls") or ()
    ]
    return {"role": "assistant", "content": result.get("text") or "", "tool_calls": calls}


def chain(messages: list[Any]) -> list[bytes]:
    """Prefix hashes: out[i] identifies messages[: i + 1]."""
    out = []
    h = b""
    for m in messages:
        h = hashlib.blake2b(h + canonical_message(m), digest_size=16).digest()
        out.append(h)
    return out


def _extend(h: bytes, message: Any) -> bytes:
    return hashlib.blake2b(h + canonical_message(message), digest_size=16).digest()


_rng = random.Random(os.urandom(16))
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _rng.seed(os.urandom(16)))


def _new_session_id() -> str:
    """A time-ordered unique id, in the form of `tensorverse.store.schema.new_id` (16 hex digits
    of ns time + 8 random hex digits), without a system call for the random part: it is made on
    the request path, where a call that releases the GIL waits behind the store's writer thread."""
    return f"{time.time_ns():016x}{_rng.getrandbits(32):08x}"


def parse_tags(value: str | None) -> dict[str, str]:
    tags: dict[str, str] = {}
    for part in (value or "").split(","):
        k, sep, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if sep and k and len(k) <= 64 and len(v) <= 256:
            tags[k] = v
    return tags


class _Session:
    __slots__ = ("id", "next_index", "last_used")

    def __init__(self, sid: str, next_index: int = 0) -> None:
        self.id = sid
        self.next_index = next_index
        self.last_used = time.monotonic()


class Sessions(Addon):
    """Assigns ``flow.session_id`` / ``flow.turn_index`` and creates session records."""

    name = "sessions"

    def __init__(
        self,
        store: Any = None,
        *,
        header: str = "X-Tensorverse-Session",
        tags_header: str = "X-Tensorverse-Tags",
        tags: dict[str, str] | None = None,
        idle_timeout_s: float = 3600.0,
        max_tracked: int = 10_000,
        new_id: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.header = header
        self.tags_header = tags_header
        self.tags = dict(tags or {})
        self.idle_timeout_s = idle_timeout_s
        self.max_tracked = max_tracked
        self.clock = clock
        self.new_id = new_id or _new_session_id
        self._prefixes: OrderedDict[bytes, str] = OrderedDict()  # chain hash -> session id
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self.counters = {"created": 0, "by_header": 0, "by_prefix": 0, "store_errors": 0, "evicted": 0}

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "tracked_sessions": len(self._sessions), "tracked_prefixes": len(self._prefixes)}

    # -- state -----------------------------------------------------------------------------------
    def _evict(self) -> None:
        now = self.clock()
        while self._sessions:
            sid, s = next(iter(self._sessions.items()))
            if len(self._sessions) > self.max_tracked or now - s.last_used > self.idle_timeout_s:
                del self._sessions[sid]
                self.counters["evicted"] += 1
            else:
                break
        while len(self._prefixes) > self.max_tracked:
            self._prefixes.popitem(last=False)

    def _touch(self, s: _Session) -> None:
        s.last_used = self.clock()
        self._sessions.move_to_end(s.id)

    def _create(self, sid: str, flow: Flow, source: str, next_index: int = 0) -> _Session:
        s = self._sessions[sid] = _Session(sid, next_index)
        s.last_used = self.clock()
        if next_index == 0:
            flow.session_is_new = True
            self.counters["created"] += 1
            tags = {**self.tags, **parse_tags(flow.headers.get(self.tags_header))}
            record = {"id": sid, "created_ns": flow.start_ns, "tags": tags, "grouping": source,
                      "endpoint": flow.kind}
            # Stored once the turn is over (`response_done`/`error`, in the background), just
            # before the recorder stores the turn: nothing reaches the store's writer thread
            # while the request is on its way.
            flow.meta["session_record"] = record
        return s

    def _put(self, record: dict) -> None:
        if self.store is None:
            return
        try:
            fut = self.store.put_session(record)
        except Exception:  # noqa: BLE001 - a closed or broken store never breaks proxying
            self.counters["store_errors"] += 1
            log.exception("cannot store session %s", record.get("id"))
            return

        def done(f: Any) -> None:
            if f.exception() is not None:
                self.counters["store_errors"] += 1
                if worth_logging(self.counters["store_errors"]):
                    log.warning("session %s not stored: %s (%d so far)", record.get("id"), f.exception(),
                                self.counters["store_errors"])

        fut.add_done_callback(done)

    def _from_store(self, sid: str) -> int | None:
        if self.store is None:
            return None
        try:
            return int(self.store.get_session(sid).get("turns", 0))
        except Exception:  # noqa: BLE001 - RecordNotFound, or a store we cannot read
            return None

    # -- hooks -----------------------------------------------------------------------------------
    def request_forwarded(self, flow: Flow) -> None:
        # Not `request`: hashing a long history (~0.1 ms for 40 messages) would delay the request;
        # here it runs while the primary works on it.
        self._evict()
        named = flow.headers.get(self.header)
        msgs = request_messages(flow.kind, flow.request_json)
        hashes = chain(msgs) if msgs else []
        flow.meta["chain_tip"] = hashes[-1] if hashes else None
        s: _Session | None = None
        if named:
            sid = named.strip() if _ID_OK.match(named.strip()) else "h-" + hashlib.blake2b(
                named.encode("utf-8", "replace"), digest_size=12).hexdigest()
            s = self._sessions.get(sid)
            if s is None:
                stored = self._from_store(sid)
                s = self._create(sid, flow, "header", stored or 0)
            self.counters["by_header"] += 1
        else:
            for h in reversed(hashes):
                sid = self._prefixes.get(h)
                if sid is not None:
                    s = self._sessions.get(sid)
                    if s is None:  # evicted from memory but known: continue it from the store
                        stored = self._from_store(sid)
                        s = self._create(sid, flow, "prefix", stored or 0)
                    self.counters["by_prefix"] += 1
                    break
            if s is None:
                s = self._create(self.new_id(), flow, "prefix")
        flow.session_id = s.id
        flow.turn_index = s.next_index
        s.next_index += 1
        self._touch(s)

    async def response_done(self, flow: Flow) -> None:
        self._put_pending(flow)
        self._remember(flow)

    async def error(self, flow: Flow) -> None:
        self._put_pending(flow)

    def _put_pending(self, flow: Flow) -> None:
        record = flow.meta.pop("session_record", None)
        if record is not None:
            self._put(record)

    def _remember(self, flow: Flow) -> None:
        tip = flow.meta.get("chain_tip")
        acc = flow.meta.get("acc")
        if tip is None or acc is None or flow.session_id is None or (flow.status or 500) >= 400:
            return
        answer = answer_message(acc.result())
        if answer is None:
            return
        key = _extend(tip, answer)
        self._prefixes[key] = flow.session_id
        self._prefixes.move_to_end(key)
        self._evict()


__all__ = ["Sessions", "canonical_message", "chain", "request_messages", "answer_message", "parse_tags", "CHAT"]
