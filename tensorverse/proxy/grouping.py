"""The session grouping rule, as pure functions over typed records (no I/O, no clock, no state).

`tensorverse.proxy.sessions` keeps the state (which sessions exist, their latest history) and
calls these functions; the unit and property tests call them directly.

Terms. A request's *history* is its messages. A session's *latest history* is the messages of its
latest main turn followed by that turn's answer. A message's *loose key* identifies its text with
all whitespace runs collapsed, tool call ids and reasoning dropped (what survives an agent's
re-rendering of its history); its *head key* identifies only the first `HEAD_CHARS` characters
of that text (what survives a note appended to a tool result or user message). The *anchor* of
a history is its leading system message (loose key) and the names of the tools it offers.

The rule, for a request ``R`` and a session ``S`` with latest history ``P`` (`continuation`):

1. *extends*: after dropping system messages that are not the first one (transient notes) from
   both, ``R`` has at least as many messages as ``P`` and agrees with ``P`` at every position:
   same role; user and tool messages equal (loose key, or head key: a transient note appended);
   assistant messages equal or edited (a repaired call, a substituted call, a rewritten text:
   edited assistant messages are allowed because the client owns its history). At least one user
   message must be equal, and the anchors equal; if the anchors differ (a system prompt that
   carries the hour), at least two user/tool messages and one assistant message must be equal.
   Score: ``len(P)``.
2. *compaction*: an assistant message of ``R`` contains the text of a side request's answer
   that the proxy relayed in ``S`` (a summary it produced now stands in the history; turnstone
   adds a "continue" note after it), and the anchors are equal. Score: ``len(P)``.
3. *tail*: the last ``k >= 2`` messages of ``P`` (an assistant message among them) appear in ``R``
   in order and adjacent, and the anchors are equal (an agent that dropped older messages
   without a summary). Score: ``k``.

The request joins the session with the highest score (ties: the most recently used). A request
that continues no session but quotes one (`quotes`: its text contains the first or latest user
message, the start of a recent tool result, or a side answer of the session, at least
`MIN_QUOTE_CHARS` characters) and has a
different anchor is a *side request* of that session (title generators, compaction summaries,
approval judges). Otherwise it opens a new session.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import orjson

HEAD_CHARS = 64
MIN_QUOTE_CHARS = 12

MAIN = "main"
SIDE = "side"

# Evidence names (stored on the turn as ``grouping.evidence``).
HEADER = "header"  # X-Tensorverse-Session
CLIENT_ID = "client_id"  # an id the client sent (Codex-style headers, Claude Code's metadata)
PREFIX = "prefix"  # the exact canonical prefix (sessions.chain)
EXTENDS = "extends"
EDITED = "edited"
COMPACTION = "compaction"
TAIL = "tail"
QUOTES = "quotes"  # a side request
NEW = "new"

_SPACE = re.compile(r"\s+")


def norm(text: str) -> str:
    """Whitespace runs collapsed to one space, ends stripped."""
    return _SPACE.sub(" ", text).strip()


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def message_text(m: Any) -> str:
    """The text a message carries (content parts joined; tool calls as ``name(args)``),
    whitespace-collapsed."""
    if not isinstance(m, dict):
        return norm(str(m))
    parts: list[str] = []
    content = m.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif p.get("type") == "tool_use":
                    parts.append(f"{p.get('name', '')}({_args(p.get('input'))})")
                elif p.get("type") == "tool_result":
                    c = p.get("content")
                    parts.append(c if isinstance(c, str) else message_text({"content": c}))
    for tc in m.get("tool_calls") or ():
        if isinstance(tc, dict):
            fn = tc.get("function") or {}
            if isinstance(fn, dict):
                parts.append(f"{fn.get('name', '')}({_args(fn.get('arguments'))})")
    return norm(" ".join(parts))


def _args(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return norm(value)
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return repr(value)


def _role(m: Any) -> str:
    role = m.get("role") if isinstance(m, dict) else None
    return role if isinstance(role, str) else "?"


@dataclass(frozen=True, slots=True)
class MessageKey:
    role: str
    loose: bytes  # 8 bytes: role + whitespace-collapsed text
    head: bytes  # 8 bytes: role + the first HEAD_CHARS characters of that text


@dataclass(frozen=True, slots=True)
class History:
    """What the rule needs of a conversation: its anchor and its messages' keys (system messages
    after the first one, transient notes, left out)."""

    system: bytes  # loose key of the leading system message (b"" when none)
    tools: bytes  # key of the offered tool names (b"" when none)
    body: tuple[MessageKey, ...]
    assistant_texts: tuple[str, ...] = ()  # a request's assistant texts (for the compaction test)

    @property
    def anchor(self) -> tuple[bytes, bytes]:
        return self.system, self.tools


def message_key(m: Any) -> MessageKey:
    role = _role(m)
    text = message_text(m)
    r = role.encode()
    return MessageKey(role, _h(r + b"\0" + text.encode("utf-8", "replace")),
                      _h(r + b"\1" + text[:HEAD_CHARS].encode("utf-8", "replace")))


def tools_key(tools: Any) -> bytes:
    names = []
    for t in tools or ():
        if isinstance(t, dict):
            f = t.get("function")
            fn = f if isinstance(f, dict) else t
            names.append(str(fn.get("name", "")))
    return _h("\0".join(sorted(names)).encode()) if names else b""


def history(messages: Sequence[Any], tools: Any = None, answer: Any = None) -> History:
    """The `History` of a request (``answer``: the assistant message that followed, if any)."""
    msgs = list(messages)
    if answer is not None:
        msgs.append(answer)
    system = b""
    start = 0
    if msgs and _role(msgs[0]) in ("system", "developer"):
        system = message_key(msgs[0]).loose
        start = 1
    kept = [m for m in msgs[start:] if _role(m) not in ("system", "developer")]
    body = tuple(message_key(m) for m in kept)
    texts = tuple(message_text(m) for m in kept if _role(m) == "assistant")
    return History(system, tools_key(tools), body, texts)


@dataclass(frozen=True, slots=True)
class Match:
    score: int
    evidence: str


def _same(a: MessageKey, b: MessageKey) -> bool:
    return a.loose == b.loose or (a.role in ("user", "tool") and a.head == b.head)


def continuation(prev: History, req: History, summaries: Sequence[str] = ()) -> Match | None:
    """Whether ``req`` continues a session whose latest history is ``prev`` (the module
    docstring's rule), with its score; ``summaries``: the session's side answers (their texts,
    `norm`-alised: an agent may add a note after the summary it puts in its history)."""
    p, r = prev.body, req.body
    same_anchor = prev.anchor == req.anchor
    best: Match | None = None
    # 1. extends (with edited assistant messages, transient notes)
    if p and len(r) >= len(p):
        equal_ut = equal_user = equal_asst = edited = 0
        for a, b in zip(p, r):
            if a.role != b.role:
                break
            if a.role == "assistant":
                if a.loose == b.loose:
                    equal_asst += 1
                else:
                    edited += 1
            elif _same(a, b):
                equal_ut += 1
                equal_user += a.role == "user"
            else:
                break
        else:
            if equal_user and (same_anchor or (equal_ut >= 2 and equal_asst >= 1)):
                best = Match(len(p), EDITED if edited else EXTENDS)
    if best is not None:
        return best
    if not same_anchor:
        return None
    # 2. compaction: a summary the proxy relayed stands in the history
    if summaries and any(quotes(t, summaries) for t in req.assistant_texts):
        return Match(len(p), COMPACTION)
    # 3. tail: the newest messages of prev, in order and adjacent
    k = _tail_overlap(p, r)
    if k >= 2:
        return Match(k, TAIL)
    return None


def _tail_overlap(p: tuple[MessageKey, ...], r: tuple[MessageKey, ...]) -> int:
    """The longest k such that p[-k:] occurs in r as adjacent messages and holds an assistant
    message (0 when none)."""
    if len(p) < 2 or not r:
        return 0
    last = p[-1]
    best = 0
    for j, m in enumerate(r):
        if m.loose != last.loose:
            continue
        k = 1
        while k < len(p) and j - k >= 0 and _same(p[-1 - k], r[j - k]):
            k += 1
        if k > best and any(x.role == "assistant" for x in p[-k:]):
            best = k
    return best


def choose(candidates: Iterable[tuple[str, Match | None]]) -> tuple[str, Match] | None:
    """The session a request joins among ``(session id, match)`` listed most recent first: the
    highest score; a tie goes to the earlier (more recent) one."""
    best: tuple[str, Match] | None = None
    for sid, m in candidates:
        if m is not None and (best is None or m.score > best[1].score):
            best = (sid, m)
    return best


def request_text(messages: Sequence[Any]) -> str:
    """All of a request's message texts, whitespace-collapsed, for `quotes`."""
    return " ".join(message_text(m) for m in messages)


def quotes(text: str, quoted: Iterable[str]) -> bool:
    """Whether ``text`` contains one of ``quoted`` (each at least MIN_QUOTE_CHARS long)."""
    return any(len(q) >= MIN_QUOTE_CHARS and q in text for q in quoted)


def first_user_text(messages: Sequence[Any]) -> str:
    for m in messages:
        if _role(m) == "user":
            return message_text(m)
    return ""


def last_user_text(messages: Sequence[Any]) -> str:
    for m in reversed(messages):
        if _role(m) == "user":
            return message_text(m)
    return ""


# -- ids that clients send -------------------------------------------------------------------
_CLAUDE_CODE_SESSION = re.compile(r"session_([0-9a-fA-F-]{16,64})")


def client_session_id(headers: Any, body: Any, header_names: Sequence[str]) -> str | None:
    """A conversation id the client itself sent, or None: the first of ``header_names`` present
    (configured, `[sessions] client_id_headers`), else the body's ``conversation`` (the Responses
    API's field, which the openai Agents SDK fills from its ``conversation_id``), else a
    ``session_<id>`` inside the Anthropic Messages API's ``metadata.user_id``. The result is
    prefixed with where it came from, so ids from different places never collide."""
    for name in header_names:
        v = headers.get(name) if headers is not None else None
        if v and v.strip():
            return f"{name.lower()}:{v.strip()}"
    if isinstance(body, dict):
        conv = body.get("conversation")
        if isinstance(conv, dict):
            conv = conv.get("id")
        if isinstance(conv, str) and conv.strip():
            return f"conversation:{conv.strip()}"
        meta = body.get("metadata")
        uid = meta.get("user_id") if isinstance(meta, dict) else None
        if isinstance(uid, str):
            m = _CLAUDE_CODE_SESSION.search(uid)
            if m:
                return f"claude-code:{m.group(1)}"
    return None


__all__ = [
    "History", "Match", "MessageKey", "continuation", "choose", "history", "message_key", "message_text",
    "norm", "quotes", "request_text", "first_user_text", "last_user_text", "client_session_id", "tools_key",
    "MAIN", "SIDE",
]
