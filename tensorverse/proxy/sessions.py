"""Sessions: group the turns of one agent conversation.

An agent resends the whole history every turn. A turn joins the session the client names
(``X-Tensorverse-Session``, or an id the client sends anyway: `grouping.client_session_id`), else
the session of an earlier turn when its messages start with that turn's messages followed by that
turn's answer (exact prefix, below), else the session whose latest history it continues best
under the tolerant rule of `tensorverse.proxy.grouping` (edited assistant messages, transient
notes, compaction), else it is a side request of a session it quotes, else it starts a new
session. Each turn is marked ``main`` or ``side`` (``flow.turn_kind``) with the evidence
that grouped it (``flow.grouping``). Sessions are stored with the configured tags (agent name, environment...), merged
with ``X-Tensorverse-Tags: key=value,key=value`` from the request that created them.

Messages are compared in a canonical form that survives what agent frameworks do to a history
they resend: ``content`` null vs "" vs a list of text parts, whitespace around the text, tool
call ids, reasoning fields dropped, argument JSON re-serialised. Histories are hashed as a chain
(h_i = H(h_{i-1}, message_i)), so finding the longest known prefix costs one dict lookup per
message and memory per turn is one 16-byte key. The index is an LRU bounded in size and idle
time. Completions (``prompt`` strings) are grouped by the header only.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import random
import re
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import orjson

from tensorverse.jsonbytes import dumps
from tensorverse.proxy import grouping
from tensorverse.proxy.flow import Addon, Flow, worth_logging
from tensorverse.proxy.protocol import CHAT, MESSAGES
from tensorverse.store.records import Session

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


@dataclass(slots=True)
class _Session:
    """What the proxy remembers of a session (bounded: `Sessions.max_tracked` sessions)."""

    id: str
    next_index: int = 0
    last_used: float = 0.0
    latest: grouping.History | None = None  # the latest main turn's messages + answer
    anchor: tuple[bytes, bytes] | None = None  # of the request that opened it (before `latest` exists)
    latest_index: int = -1
    first_user: str = ""
    last_user: str = ""
    # side answers (norm), the last 8; a tuple, not a deque: an empty deque holds a 64-slot block
    # (760 bytes), more than the rest of a session here, and most sessions never have one
    side_texts: tuple[str, ...] = ()
    probes: tuple[str, ...] = ()  # starts of the latest tool results (for `quotes`)
    # its record until a turn carrying it has finished: every turn that joins before then carries
    # a copy, since it may finish (and be stored) before the turn that opened the session
    unstored: Session | None = None


@dataclass(slots=True)
class _Orphan:
    """A request with no tools that opened a session of its own: it may be the side request of
    a conversation whose first turn has not reached the proxy yet (turnstone sends its title
    request alongside the first turn)."""

    session_id: str
    flow: Flow
    text: str
    at: float


DEFAULT_CLIENT_ID_HEADERS = ("x-session-id", "session_id", "conversation_id")
_CANDIDATES = 8  # sessions evaluated by the tolerant rule per request
_QUOTE_SCAN = 32  # recent sessions a side request is looked for in
_ORPHAN_S = 300.0


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
        client_id_headers: tuple[str, ...] | list[str] = DEFAULT_CLIENT_ID_HEADERS,
        new_id: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.header = header
        self.tags_header = tags_header
        self.tags = dict(tags or {})
        self.idle_timeout_s = idle_timeout_s
        self.max_tracked = max_tracked
        self.client_id_headers = tuple(client_id_headers)
        self.clock = clock
        self.new_id = new_id or _new_session_id
        self._prefixes: OrderedDict[bytes, str] = OrderedDict()  # chain hash -> session id
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._by_key: OrderedDict[bytes, str] = OrderedDict()  # loose message key -> session id
        self._orphans: deque[_Orphan] = deque(maxlen=64)
        self._pending_moves: dict[str, list[tuple[str, int]]] = {}  # session id -> (turn id, index)
        self.counters = {"created": 0, "by_header": 0, "by_client_id": 0, "by_prefix": 0, "by_rule": 0,
                         "side": 0, "side_linked_late": 0, "store_errors": 0, "evicted": 0}

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
        while len(self._by_key) > 16 * self.max_tracked:
            self._by_key.popitem(last=False)

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
            record = Session(id=sid, created_ns=flow.start_ns, tags=tags, grouping=source, endpoint=flow.kind)
            # Stored once the turn is over (`response_done`/`error`, in the background), just
            # before the recorder stores the turn: nothing reaches the store's writer thread
            # while the request is on its way.
            flow.session_record = s.unstored = record
        return s

    def _put(self, record: Session) -> None:
        if self.store is None:
            return
        self._watch(self._submit(lambda: self.store.put_session(record)), f"session {record.id}")

    def _submit(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception:
            self.counters["store_errors"] += 1
            log.exception("store write refused")
            return None

    def _watch(self, fut: Any, what: str) -> None:
        if fut is None:
            return

        def done(f: Any) -> None:
            if f.exception() is not None:
                self.counters["store_errors"] += 1
                if worth_logging(self.counters["store_errors"]):
                    log.warning("%s not stored: %s (%d so far)", what, f.exception(), self.counters["store_errors"])

        fut.add_done_callback(done)

    def _from_store(self, sid: str) -> int | None:
        if self.store is None:
            return None
        try:
            return int(self.store.get_session(sid).turns)
        except Exception:  # noqa: BLE001 - RecordNotFound, or a store we cannot read
            return None

    def _named(self, sid: str, flow: Flow, source: str) -> _Session:
        s = self._sessions.get(sid)
        if s is None:
            stored = self._from_store(sid)
            s = self._create(sid, flow, source, stored or 0)
        return s

    # -- hooks -----------------------------------------------------------------------------------
    def request_forwarded(self, flow: Flow) -> None:
        # Not `request`: hashing a long history (~0.1 ms for 40 messages) would delay the request;
        # here it runs while the primary works on it. The tolerant rule runs only when the exact
        # prefix finds nothing; the latest histories it compares with are made in `response_done`.
        self._evict()
        named = flow.headers.get(self.header)
        msgs = request_messages(flow.kind, flow.request_json)
        hashes = chain(msgs) if msgs else []
        flow.chain_tip = hashes[-1] if hashes else None
        flow.messages = msgs
        kind, evidence, score = grouping.MAIN, grouping.NEW, 0
        s: _Session | None = None
        if named:
            sid = named.strip() if _ID_OK.match(named.strip()) else "h-" + hashlib.blake2b(
                named.encode("utf-8", "replace"), digest_size=12).hexdigest()
            s = self._named(sid, flow, "header")
            evidence = grouping.HEADER
            self.counters["by_header"] += 1
        elif (cid := grouping.client_session_id(flow.headers, flow.request_json, self.client_id_headers)) is not None:
            s = self._named("c-" + hashlib.blake2b(cid.encode("utf-8", "replace"), digest_size=12).hexdigest(),
                            flow, "client_id")
            evidence = grouping.CLIENT_ID
            self.counters["by_client_id"] += 1
        else:
            for i in range(len(hashes) - 1, -1, -1):
                known = self._prefixes.get(hashes[i])
                if known is not None:
                    s = self._sessions.get(known)
                    if s is None:  # evicted from memory but known: continue it from the store
                        stored = self._from_store(known)
                        s = self._create(known, flow, "prefix", stored or 0)
                    evidence, score = grouping.PREFIX, i + 1
                    self.counters["by_prefix"] += 1
                    break
            if s is None and msgs:
                tools = flow.request_json.get("tools") if isinstance(flow.request_json, dict) else None
                hist = grouping.history(msgs, tools)
                flow.history = hist
                found = self._by_rule(hist)
                if found is not None:
                    s, m = found
                    evidence, score = m.evidence, m.score
                    self.counters["by_rule"] += 1
                else:
                    text = grouping.request_text(msgs)
                    side = self._quoted_by(text, hist)
                    if side is not None:
                        s, kind, evidence = side, grouping.SIDE, grouping.QUOTES
                        self.counters["side"] += 1
                    else:
                        s = self._create(self.new_id(), flow, "prefix")
                        s.anchor = hist.anchor
                        if not tools:
                            self._orphans.append(_Orphan(s.id, flow, text, self.clock()))
                        else:
                            self._adopt_orphans(s, msgs)
            if s is None:
                s = self._create(self.new_id(), flow, "prefix")
        flow.session_id = s.id
        flow.turn_index = s.next_index
        if s.unstored is not None and flow.session_record is None:
            flow.session_record = copy.copy(s.unstored)
        flow.turn_kind = kind
        flow.grouping = {"evidence": evidence, "score": score}
        s.next_index += 1
        if kind == grouping.MAIN and msgs:
            s.last_user = grouping.last_user_text(msgs) or s.last_user
            if not s.first_user:
                s.first_user = grouping.first_user_text(msgs)
        self._touch(s)

    def _by_rule(self, hist: grouping.History) -> tuple[_Session, grouping.Match] | None:
        """The tolerant rule over the sessions that share a message with the request."""
        hits: dict[str, int] = {}
        for k in hist.body:
            sid = self._by_key.get(k.loose) or (self._by_key.get(k.head) if k.role == "assistant" else None)
            if sid is not None:
                hits[sid] = hits.get(sid, 0) + 1
        if not hits:
            return None
        order = sorted(hits, key=lambda sid: -hits[sid])[:_CANDIDATES]
        cands = [self._sessions[sid] for sid in order if sid in self._sessions]
        cands.sort(key=lambda s: -s.last_used)
        best = grouping.choose((s.id, grouping.continuation(s.latest, hist, s.side_texts) if s.latest else None) for s in cands)
        return None if best is None else (self._sessions[best[0]], best[1])

    def _quoted_by(self, text: str, hist: grouping.History) -> _Session | None:
        """The most recent session this request quotes and whose anchor it does not share."""
        if len(text) < grouping.MIN_QUOTE_CHARS:  # too short to quote anything (a health check, "hi")
            return None
        anchor = hist.anchor
        for i, s in enumerate(reversed(self._sessions.values())):
            if i >= _QUOTE_SCAN:
                break
            if grouping.quotes(text, (s.first_user, s.last_user, *s.side_texts, *s.probes)) and \
                    (s.latest.anchor if s.latest is not None else s.anchor) != anchor:
                return s  # quoted, with another system prompt or tools: a side request
        return None

    def _adopt_orphans(self, s: _Session, msgs: list[Any]) -> None:
        """Link to a new conversation the side requests that reached the proxy before it."""
        first = grouping.first_user_text(msgs)
        now = self.clock()
        for o in list(self._orphans):
            if now - o.at > _ORPHAN_S or not grouping.quotes(o.text, (first,)):
                continue
            self._orphans.remove(o)
            f = o.flow
            orphan = self._sessions.pop(o.session_id, None)
            if orphan is None or orphan.next_index != 1:
                continue  # the orphan session went on: it is a conversation of its own
            f.turn_kind = grouping.SIDE
            f.grouping = {"evidence": grouping.QUOTES, "score": 0, "linked_late": True}
            self.counters["side"] += 1
            self.counters["side_linked_late"] += 1
            index = s.next_index
            s.next_index += 1
            if not f.recorded:
                # its turn is not stored yet: it is simply recorded in this session, whose record
                # it carries too (it may finish first; the store keeps one record, `put_session`)
                f.session_record = None
                if s.unstored is not None:
                    f.session_record = copy.copy(s.unstored)
                f.session_id, f.turn_index = s.id, index
                self.counters["created"] -= 1
            else:  # stored already: moved once this turn's session record is (`_put_pending`)
                f.linked_to = s.id
                if f.turn is not None and f.turn.id:
                    self._pending_moves.setdefault(s.id, []).append((f.turn.id, index))

    async def response_done(self, flow: Flow) -> None:
        self._put_pending(flow)
        self._remember(flow)
        flow.recorded = True  # the recorder, next in line, stores the turn now

    async def error(self, flow: Flow) -> None:
        self._put_pending(flow)
        flow.recorded = True

    def _put_pending(self, flow: Flow) -> None:
        record, flow.session_record = flow.session_record, None
        if record is not None:
            self._put(record)
            s = self._sessions.get(record.id)
            if s is not None:
                s.unstored = None
        moves = self._pending_moves.pop(flow.session_id, None) if flow.session_id else None
        for tid, index in moves or ():
            if self.store is not None:
                self._watch(self._submit(partial(
                    self.store.move_turn, tid, flow.session_id, index, kind=grouping.SIDE, by="proxy",
                    reason="side request linked to its conversation", drop_empty=True)), f"side turn {tid}")

    def _remember(self, flow: Flow) -> None:
        tip = flow.chain_tip
        acc = flow.acc
        if tip is None or acc is None or flow.session_id is None or (flow.status or 500) >= 400:
            return
        answer = answer_message(acc.result())
        if answer is None:
            return
        s = self._sessions.get(flow.session_id)
        if flow.turn_kind == grouping.SIDE:
            if s is not None and answer["content"]:
                s.side_texts = (*s.side_texts[-7:], grouping.norm(answer["content"]))
                self._index(grouping.message_key(answer).loose, s.id)
                self._index(grouping.message_key(answer).head, s.id)
            return
        key = _extend(tip, answer)
        self._prefixes[key] = flow.session_id
        self._prefixes.move_to_end(key)
        if s is not None and (flow.turn_index or 0) >= s.latest_index:
            hist = flow.history
            req = flow.request_json if isinstance(flow.request_json, dict) else {}
            if hist is None:
                hist = grouping.history(flow.messages or (), req.get("tools"))
            s.latest = grouping.History(hist.system, hist.tools, hist.body + (grouping.message_key(answer),))
            s.latest_index = flow.turn_index or 0
            msgs = flow.messages or ()
            # tool results only: user messages are quoted whole (first_user/last_user), as two
            # conversations may open alike ("Read f0.txt ... (run 0)" / "(run 1)")
            s.probes = tuple(t[:96] for m in msgs[-12:] if isinstance(m, dict) and m.get("role") == "tool"
                             and len(t := grouping.message_text(m)) >= grouping.MIN_QUOTE_CHARS)
            for k in s.latest.body:
                self._index(k.loose, s.id)
        self._evict()

    def _index(self, key: bytes, sid: str) -> None:
        self._by_key[key] = sid
        self._by_key.move_to_end(key)


__all__ = ["Sessions", "canonical_message", "chain", "request_messages", "answer_message", "parse_tags", "CHAT"]
