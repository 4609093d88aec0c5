"""The recorded turn as the shadow runner reads it: :class:`TurnInput` and its normalisation.

The turn is a stored turn record (`tensorverse.store.records.Turn`, or its dict, decoded here):
the runner uses its ``id``, ``session_id``, ``prompt_token_ids``, ``output_token_ids``, ``text``,
``sampling`` (the primary's ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``max_tokens``, ``stop``, ``stop_token_ids``, penalties; read from ``request`` when absent),
``top_logprobs`` (one entry per output position, any form
:func:`tensorverse.analysis.topk.parse_top_logprobs` reads; else read from
``choices[0].logprobs``), ``pieces`` (decoded text of each output token), ``request`` (the chat
request, for the template check), ``tool_calls``, ``backend`` (the primary backend's name),
``finish_reason``, ``model`` and ``endpoint``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from tensorverse.store import records
from tensorverse.store.records import Turn
from tensorverse.store.turns import UPSTREAM_LOGPROBS, logprobs_values

__all__ = ["TurnInput", "normalize_topk"]

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
                  "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _ids(value: Any, what: str) -> list[int]:
    if value is None:
        raise ValueError(f"turn: {what} missing")
    try:
        out = [int(v) for v in value]
    except (TypeError, ValueError):
        raise ValueError(f"turn: {what} must be a list of token ids") from None
    if any(v < 0 for v in out):
        raise ValueError(f"turn: {what} holds a negative token id")
    return out


_TOKEN_ID = "token_id:"


def _completions_topk(entry: dict) -> list[list[float]] | None:
    """The common case of :func:`normalize_topk`, read without the general parser: a completions
    answer's ``{"token_id:N": logprob}`` with float logprobs in (-9999, 0]. None for anything else
    (the general parser decides it). About three times faster: a shadow run of n tokens parses n of
    these (six runs a turn behind three shadows), on the relay's loop."""
    d: dict[int, float] = {}
    for k, v in entry.items():
        if type(k) is not str or type(v) is not float or not -9999.0 < v <= 0.0 or not k.startswith(_TOKEN_ID):
            return None
        try:
            d[int(k[9:])] = v
        except ValueError:
            return None
    return [[t, -nlp] for nlp, t in sorted([(-lp, t) for t, lp in d.items()])]


def normalize_topk(entry: Any) -> list[list[float]] | None:
    """One position's top-k logprobs as ``[[token_id, logprob], ...]``, most likely first."""
    if entry is None:
        return None
    if type(entry) is dict and "top_logprobs" not in entry:
        fast = _completions_topk(entry)
        if fast is not None:
            return fast
    return _general_topk(entry)


def _general_topk(entry: Any) -> list[list[float]] | None:
    """:func:`normalize_topk` through :func:`tensorverse.analysis.topk.parse_top_logprobs`: any
    form it reads; None for an entry it refuses."""
    from tensorverse.analysis.topk import parse_top_logprobs

    try:
        d = parse_top_logprobs(entry)
    except ValueError:
        return None
    return [[int(t), (lp if math.isfinite(lp) else -9999.0)]
            for t, lp in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))]


def _recorded_logprobs(turn: Turn, n: int) -> tuple[list | None, list | None]:
    """Top-k and pieces from the proxy's record of the primary's answer: ``choices[0].logprobs``
    is a list of ``{"token", "logprob", "top": [[token, logprob], ...]}`` where a token is an int
    (the answer used ``token_id:N`` keys) or the decoded text. A turn straight from the proxy
    may still hold them as received (``upstream_logprobs``): converted here, only when needed."""
    choices = turn.choices
    ch = choices[0] if choices and isinstance(choices[0], Mapping) else None
    lps = ch.get("logprobs") if ch else None
    if lps is None and ch is not None and UPSTREAM_LOGPROBS in ch:
        lps = logprobs_values(ch[UPSTREAM_LOGPROBS])
    if not isinstance(lps, list) or len(lps) != n or not n:
        return None, None
    tops: list[dict[int, float] | None] = []
    pieces: list[str] | None = []
    for e in lps:
        if not isinstance(e, Mapping):
            tops.append(None)
            pieces = None
            continue
        d: dict[int, float] = {}
        for pair in e.get("top") or ():
            if isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], int) \
                    and isinstance(pair[1], (int, float)):
                d[pair[0]] = float(pair[1])
        tok = e.get("token")
        if isinstance(tok, int) and isinstance(e.get("logprob"), (int, float)):
            d.setdefault(tok, float(e["logprob"]))
        tops.append(d or None)
        if pieces is not None:
            if isinstance(tok, str):
                pieces.append(tok)
            else:
                pieces = None
    return tops, pieces


@dataclass
class TurnInput:
    """What the runner needs of a recorded turn (see the module docstring for the dict form)."""

    id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    session_id: str | None = None
    text: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    top_logprobs: list[list[list[float]] | None] | None = None
    pieces: list[str] | None = None
    request: dict[str, Any] | None = None
    tool_calls: Any = None
    primary: str | None = None
    finish_reason: str | None = None
    model: str | None = None
    endpoint: str | None = None  # the proxy's kind: chat.completions, completions, messages

    @property
    def chat_request(self) -> dict[str, Any] | None:
        """The OpenAI chat request to render for the template check (None for completions and
        Anthropic ``messages`` requests, whose messages are not in the chat template's form)."""
        if not self.request or not self.request.get("messages"):
            return None
        if self.endpoint not in (None, "chat.completions"):
            return None
        return self.request

    @classmethod
    def from_dict(cls, turn: Mapping[str, Any] | Turn | "TurnInput") -> "TurnInput":
        """A stored turn (a `Turn`, or its dict) as the runner needs it; ValueError when it cannot
        be run (no id, no prompt, no output ids, a field of the wrong type)."""
        if isinstance(turn, TurnInput):
            return turn
        t = records.turn(turn)
        if not t.id:
            raise ValueError("turn: id missing")
        prompt = _ids(t.prompt_token_ids, "prompt_token_ids")
        output = _ids(t.output_token_ids, "output_token_ids")
        if not prompt:
            raise ValueError("turn: prompt_token_ids is empty")
        request = t.request
        sampling = dict(t.sampling or {})
        if not sampling and request:
            sampling = {k: request[k] for k in _SAMPLING_KEYS if request.get(k) is not None}
            if "max_tokens" not in sampling and request.get("max_completion_tokens") is not None:
                sampling["max_tokens"] = request["max_completion_tokens"]
        tops: Any = t.top_logprobs
        pieces: Any = t.pieces
        if tops is None:
            tops, lp_pieces = _recorded_logprobs(t, len(output))
            if pieces is None:
                pieces = lp_pieces
        top_logprobs = None
        if isinstance(tops, list) and len(tops) == len(output):
            top_logprobs = [normalize_topk(e) for e in tops]
            if all(e is None for e in top_logprobs):
                top_logprobs = None
        if not (isinstance(pieces, list) and len(pieces) == len(output)
                and all(isinstance(p, str) for p in pieces)):
            pieces = None
        return cls(
            id=t.id,
            prompt_token_ids=prompt,
            output_token_ids=output,
            session_id=t.session_id,
            text=t.text,
            sampling=sampling,
            top_logprobs=top_logprobs,
            pieces=pieces,
            request=dict(request) if request else None,
            endpoint=t.endpoint,
            tool_calls=t.tool_calls,
            primary=t.backend,
            finish_reason=t.finish_reason,
            model=t.model or (request or {}).get("model"),
        )
