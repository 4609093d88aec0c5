"""The viewer's own view of a turn: the stored records (`tensorverse.store.records`, typed)
turned into one :class:`Lane` per backend and mode, and a :class:`TurnRec` for the turn.

Writers (`tensorverse.store.records` has every field):

* the proxy's recorder writes **turns**: the client's ``request``, ``prompt_token_ids``,
  ``output_token_ids``, ``text``, ``reasoning``, ``tool_calls``, ``choices[0].logprobs``
  (``{"token", "logprob", "top"}`` per position), ``backend`` (the primary's name), ``state``;
* the shadow runner writes **runs**: the primary's own answer as mode ``recorded`` (id ``<turn
  id>~primary``: normalised ``top_logprobs``, ``pieces``, ``text``, ``tool_calls``) and, per shadow
  backend, modes ``forced`` and ``free``;
* :mod:`tensorverse.shadow.compare` writes **comparisons**.

What stays loose here is only what the writers themselves store in several forms: a position's
top-k (:func:`topk_entry` reads each form) and pieces, which a lane takes from the record's own
field or, for a turn, from ``choices[0].logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from tensorverse.store.records import FORCED, FREE, RECORDED, BackendInfo, ForcedComparison, Run, Turn

__all__ = ["Lane", "TurnRec", "lane_from_run", "turn_from_record", "primary_name", "backend_infos",
           "comparison_flips", "topk_entry", "FORCED", "FREE", "RECORDED", "ROLES_REFERENCE",
           "PRIMARY_DEFAULT"]

PRIMARY_DEFAULT = "primary"  # a turn's backend when neither it nor a backend record names one
ROLES_REFERENCE = ("secondary", "reference")  # in order of preference, as compare.py


def _strs(v: Any, n: int | None) -> list[str] | None:
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) or s is None for s in v):
        return None
    out = ["" if s is None else s for s in v]
    if n is not None and len(out) != n:
        return None
    return out


def _topk(v: Any) -> list | None:
    """Per-position top-k entries; also accepts the OpenAI completions/chat ``logprobs`` objects
    (each entry is read later by :func:`topk_entry`)."""
    if v is None:
        return None
    if isinstance(v, Mapping):
        if "top_logprobs" in v:  # completions API: {"tokens", "token_logprobs", "top_logprobs"}
            return _topk(v["top_logprobs"])
        if "content" in v:  # chat API: {"content": [{"token", "logprob", "top_logprobs"}]}
            return _topk(v["content"])
        return None
    if isinstance(v, (list, tuple)):
        return list(v)
    return None


def topk_entry(entry: Any) -> dict[int, float] | None:
    """One position's top-k as ``{token id: logprob}``, from any form a writer uses: the shadow
    runner's ``[[id, logprob], ...]``, vLLM's ``{"token_id:N": logprob}``, chat API items, or the
    proxy's ``{"token", "logprob", "top": [[token, logprob], ...]}``. None when unreadable
    (e.g. keyed by token text instead of ids)."""
    from tensorverse.analysis.topk import parse_top_logprobs

    if entry is None:
        return None
    if isinstance(entry, Mapping) and "top" in entry and "top_logprobs" not in entry:
        d: dict[int, float] = {}
        for pair in entry.get("top") or ():
            if isinstance(pair, (list, tuple)) and len(pair) == 2:
                try:
                    d.update(parse_top_logprobs([pair]))
                except ValueError:
                    return None
        tok, lp = entry.get("token"), entry.get("logprob")
        if tok is not None and lp is not None:
            try:
                for k, v in parse_top_logprobs([[tok, lp]]).items():
                    d.setdefault(k, v)
            except ValueError:
                return None
        return d or None
    try:
        return parse_top_logprobs(entry) or None
    except ValueError:
        return None


def _choice_logprobs(turn: Turn, n: int) -> tuple[list | None, list[str] | None]:
    """Top-k entries and pieces from the proxy's ``choices[0].logprobs`` (text tokens give the
    pieces; ``token_id:N`` tokens give none)."""
    ch = turn.choices[0] if turn.choices and isinstance(turn.choices[0], Mapping) else None
    lps = ch.get("logprobs") if ch else None
    if not isinstance(lps, list) or len(lps) != n or not n:
        return None, None
    pieces: list[str] | None = []
    for e in lps:
        tok = e.get("token") if isinstance(e, Mapping) else None
        if pieces is not None and isinstance(tok, str) and not tok.startswith("token_id:"):
            pieces.append(tok)
        else:
            pieces = None
    return list(lps), pieces


@dataclass
class Lane:
    """One backend's output for a turn in one mode (or the primary's recorded answer)."""

    backend: str
    mode: str
    run_id: str | None
    token_ids: list[int]
    pieces: list[str] | None = None
    text: str | None = None
    topk: list | None = None
    tool_calls: Any = None
    status: str = "ok"
    error: str | None = None
    role: str = "shadow"
    capture: str | None = None
    positions: list[int] | None = None  # positions with stored rows, when the run lists them
    created_ns: int = 0
    token_texts: dict[str, str] | None = None  # {token id: text} beyond its own tokens

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class TurnRec:
    id: str
    session_id: str | None  # None only for a turn that is not stored (a replay case's)
    index: int
    created_ns: int
    primary: str
    prompt_ids: list[int] | None
    prompt_text: str | None
    messages: list | None
    reference: str | None
    state: str | None
    lane: Lane  # the primary's answer


def primary_name(turn: Turn, backends: Mapping[str, BackendInfo] = {}) -> str:
    if turn.backend:
        return turn.backend
    for b, info in backends.items():
        if info.role == "primary":
            return b
    return PRIMARY_DEFAULT


def _prompt(turn: Turn) -> tuple[list | None, str | None]:
    """(messages, prompt text) of the recorded request."""
    msgs, text = None, None
    req = turn.request
    if req is not None:
        msgs = req.get("messages")
        system = req.get("system")  # Anthropic messages API
        if system and isinstance(msgs, list):
            msgs = [{"role": "system", "content": system}, *msgs]
        if isinstance(req.get("prompt"), str):
            text = req["prompt"]
    if text is None:
        text = turn.request_text
    return (msgs if isinstance(msgs, list) else None), text


def turn_from_record(turn: Turn, backends: Mapping[str, BackendInfo] = {}) -> TurnRec:
    name = primary_name(turn, backends)
    ids = list(turn.output_token_ids or [])
    topk = _topk(turn.top_logprobs)
    pieces = _strs(turn.pieces, len(ids))
    if topk is None or pieces is None:
        c_topk, c_pieces = _choice_logprobs(turn, len(ids))
        topk = topk if topk is not None else c_topk
        pieces = pieces if pieces is not None else c_pieces
    lane = Lane(
        backend=name,
        mode=RECORDED,
        run_id=None,
        token_ids=ids,
        pieces=pieces,
        text=turn.text,
        topk=topk,
        tool_calls=turn.tool_calls or None,
        role="primary",
        created_ns=turn.created_ns,
        token_texts=turn.token_texts,
    )
    msgs, prompt_text = _prompt(turn)
    return TurnRec(
        id=turn.id,
        session_id=turn.session_id,
        index=turn.index,
        created_ns=turn.created_ns,
        primary=name,
        prompt_ids=turn.prompt_token_ids,
        prompt_text=prompt_text,
        messages=msgs,
        reference=turn.reference,
        state=turn.state,
        lane=lane,
    )


def lane_from_run(run: Run, backends: Mapping[str, BackendInfo] = {}) -> Lane:
    info = backends.get(run.backend)
    return Lane(
        backend=run.backend,
        mode=run.mode,
        run_id=run.id,
        token_ids=list(run.token_ids),
        pieces=_strs(run.pieces, len(run.token_ids)),
        text=run.text,
        topk=_topk(run.top_logprobs),
        tool_calls=run.tool_calls or None,
        status=run.status,
        error=run.error,
        role=run.role or (info.role if info is not None else None) or "shadow",
        capture=run.capture,
        positions=run.positions,
        created_ns=run.created_ns,
        token_texts=run.token_texts,
    )


def comparison_flips(cmp: ForcedComparison) -> int | None:
    """How many forced flips a comparison found (its ``flips`` list, or its summary's count)."""
    if cmp.flips is not None:
        return len(cmp.flips)
    flips = (cmp.summary or {}).get("flips")
    if isinstance(flips, (list, tuple)):
        return len(flips)
    if isinstance(flips, (int, float)) and not isinstance(flips, bool):
        return int(flips)
    return None


def backend_infos(records: Iterable[BackendInfo]) -> dict[str, BackendInfo]:
    """The stored backend records by name (a record without a name is left out)."""
    return {r.name: r for r in records if r.name}
