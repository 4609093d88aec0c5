"""A recorded turn as readers see it: parts the recorder keeps as the upstream wrote them are
given the canonical shape when the turn is read.

The canonical shape of a choice's ``logprobs``: a list, per output token, of ``{"token",
"logprob", "top": [[token, logprob], ...]}``, where a token is an int for vLLM's ``token_id:N``
(``return_tokens_as_token_ids``) and the text otherwise.

Why some of it is kept raw: reshaping the primary's top-k logprobs (a dict and lists per token,
then their JSON again) was the largest cost of recording a streamed turn, paid on the proxy's
event loop for every turn although most are never read (issue 4: about 0.2 ms of 1 ms per
32-token turn with top-5). A choice recorded from vLLM's chat stream therefore holds
``upstream_logprobs`` instead: the list of its events' ``logprobs`` objects (``{"content":
[...]}``), JSON exactly as received (`tensorverse.jsonbytes.RawJSON` in memory, a list once
stored), and ``logprobs`` null. `read_turn` converts them; the store does so for every turn it
returns (`Store.get_turn`, `Store.iter_turns`), the shadow tee for the turns it runs.
"""

from __future__ import annotations

import operator
from typing import Any

from tensorverse.jsonbytes import RawJSON

UPSTREAM_LOGPROBS = "upstream_logprobs"


def token_key(token: str) -> int | str:
    """``"token_id:123"`` (vLLM's return_tokens_as_token_ids) -> 123; other tokens unchanged."""
    if token.startswith("token_id:"):
        try:
            return int(token[9:])
        except ValueError:
            return token
    return token


class _TokenKeys(dict):
    """token (as vLLM writes it) -> `token_key` of its ``str``; a cache, as every token of every
    response goes through it (at most a vocabulary's worth of entries, then it starts over)."""

    LIMIT = 1 << 19

    def __missing__(self, token: Any) -> int | str:
        key = token_key(str(token))
        if token.__class__ is str:
            if len(self) >= self.LIMIT:
                self.clear()
            self[token] = key
        return key


_TOKEN_KEYS = _TokenKeys()
_token_and_logprob = operator.itemgetter("token", "logprob")


def chat_logprobs(content: list[dict] | None) -> list[dict]:
    """A chat ``logprobs.content`` list in the canonical shape (entries that are not objects
    are left out)."""
    keys = _TOKEN_KEYS
    pair = _token_and_logprob
    out = []
    try:  # vLLM's shape: every item and top entry an object with a token and a logprob
        for item in content or ():
            token, logprob = pair(item)
            tops = item.get("top_logprobs")
            out.append({"token": keys[token], "logprob": logprob,
                        "top": [[keys[t], lp] for t, lp in map(pair, tops)] if tops else []})
    except (KeyError, TypeError, AttributeError):  # anything else: the long way
        return _chat_logprobs_slow(content)
    return out


def _chat_logprobs_slow(content: Any) -> list[dict]:
    out = []
    for item in content or ():
        if not isinstance(item, dict):
            continue
        top = item.get("top_logprobs") or ()
        if not isinstance(top, (list, tuple)):
            top = ()
        out.append(
            {
                "token": token_key(str(item.get("token", ""))),
                "logprob": item.get("logprob"),
                "top": [[token_key(str(t.get("token", ""))), t.get("logprob")] for t in top if isinstance(t, dict)],
            }
        )
    return out


def logprobs_values(values: Any) -> list[dict]:
    """Chat ``logprobs`` objects (each ``{"content": [...]}`` or null; or their JSON text) in
    the canonical shape, one after the other."""
    if values.__class__ is RawJSON:
        values = values.loads()
    out: list[dict] = []
    for value in values if isinstance(values, list) else ():
        content = value.get("content") if isinstance(value, dict) else None
        if content:
            out.extend(chat_logprobs(content))
    return out


def read_turn(turn: dict) -> dict:
    """``turn`` with its choices' ``upstream_logprobs`` converted into ``logprobs`` (in place;
    a turn without them is returned as it is)."""
    for choice in turn.get("choices") or ():
        if isinstance(choice, dict) and UPSTREAM_LOGPROBS in choice:
            choice["logprobs"] = logprobs_values(choice.pop(UPSTREAM_LOGPROBS)) or None
    return turn


__all__ = ["UPSTREAM_LOGPROBS", "chat_logprobs", "logprobs_values", "read_turn", "token_key"]
