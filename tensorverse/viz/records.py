"""How the viewer reads raw store records: every field name it relies on lives here.

Writers (read their docstrings for the full record shapes):

* the proxy's recorder (:mod:`tensorverse.proxy.recorder`) writes sessions and **turns**: the
  client's ``request`` (``messages``/``prompt``), ``prompt_token_ids``, ``output_token_ids``,
  ``text`` (the content; reasoning and tool calls are split out by the chat API), ``reasoning``,
  ``tool_calls`` (OpenAI form), ``choices[0].logprobs`` (``{"token", "logprob", "top"}`` per
  position), ``backend`` (the primary's name), ``state``;
* the shadow runner (:mod:`tensorverse.shadow.runner`) writes **runs**: the primary's own answer
  as mode ``recorded`` (id ``<turn id>~primary``: normalised ``top_logprobs`` as ``[[id, logprob],
  ...]`` per position, ``pieces``, ``text``, ``tool_calls``) and, per shadow backend, modes
  ``forced`` and ``free`` (``token_ids``, ``text``, ``top_logprobs``, ``capture`` full/topk,
  ``rows`` ``{expected, present, complete}``, ``status`` ok/failed/timeout/refused, ``error``);
* :mod:`tensorverse.shadow.compare` writes **comparisons** (forced: per-position ``metrics``
  columns, ``flips`` positions, ``kind`` full/topk; free: ``divergence``, ``verdict``).

This module turns those dicts into small normalised objects (:class:`TurnRec`, :class:`Lane`) so
the rest of the viewer never indexes a raw record. Each field is looked up under a short list of
accepted names (first present wins), so a writer renaming a field is a one-line change here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["F", "Lane", "TurnRec", "pick", "lane_from_run", "turn_from_record", "primary_name",
           "backend_infos", "comparison_flips", "FORCED", "FREE", "RECORDED"]

FORCED = "forced"
FREE = "free"
RECORDED = "recorded"  # the primary's own answer, as the shadow runner stores it


class F:
    """Accepted field names, in order of preference."""

    # session
    SESSION_TAGS = ("tags",)
    SESSION_CREATED = ("created_ns",)
    SESSION_UPDATED = ("updated_ns",)
    SESSION_TURNS = ("turns",)
    # turn (the proxy's record of the primary's request and answer)
    TURN_INDEX = ("index",)
    TURN_CREATED = ("created_ns",)
    TURN_PRIMARY = ("primary", "backend", "primary_backend")
    TURN_PROMPT_IDS = ("prompt_token_ids",)
    TURN_PROMPT_TEXT = ("prompt_text",)
    TURN_MESSAGES = ("messages",)
    TURN_REQUEST = ("request",)  # the recorded request body (``messages``/``prompt``/``system``)
    TURN_OUTPUT_IDS = ("output_token_ids", "token_ids", "completion_token_ids")
    TURN_OUTPUT_TEXT = ("text", "output_text", "completion_text")
    TURN_REASONING = ("reasoning",)
    TURN_PIECES = ("pieces", "output_pieces")
    TURN_TOPK = ("top_logprobs", "output_top_logprobs")
    TURN_CHOICES = ("choices",)  # choices[0].logprobs: [{"token", "logprob", "top"}]
    TURN_TOOL_CALLS = ("tool_calls", "output_tool_calls")
    TURN_REFERENCE = ("reference", "reference_backend")
    TURN_STATE = ("state",)
    # run (one backend, one mode, one turn)
    RUN_TURN = ("turn_id",)
    RUN_BACKEND = ("backend",)
    RUN_MODE = ("mode",)
    RUN_IDS = ("token_ids", "output_token_ids")
    RUN_TEXT = ("text", "output_text")
    RUN_PIECES = ("pieces", "output_pieces")
    RUN_TOPK = ("top_logprobs",)
    RUN_TOOL_CALLS = ("tool_calls",)
    RUN_STATUS = ("status",)
    RUN_ERROR = ("error", "reason")
    RUN_ROLE = ("role",)
    RUN_CAPTURE = ("capture",)  # "full" (rows in the store) / "topk" / "none"
    RUN_POSITIONS = ("positions", "captured_positions")  # positions that have rows, when listed
    RUN_ROWS = ("rows",)  # {"expected", "present", "complete"} (or a count)
    RUN_APPROX = ("approximate",)
    RUN_PARSER_CHECK = ("parser_check",)  # recorded runs: the primary's ids re-parsed (issue 19)
    # {token id: text} for ids beyond a record's own tokens (top-k alternatives), on a turn or
    # run, when a writer adds it; without it such tokens show as #id
    TOKEN_TEXTS = ("token_texts",)
    # backend records
    BACKEND_ROLE = ("role",)
    BACKEND_MODEL = ("model",)
    BACKEND_CAPTURE = ("capture",)
    BACKEND_SETTINGS = ("settings",)
    # comparison records: only hints (flip counts in lists) and a cache of per-position metrics
    CMP_FLIPS = ("flips", "n_flips")  # a list of positions, or a count
    CMP_SUMMARY = ("summary",)
    CMP_METRICS = ("metrics",)  # per-position columns: kl, delta_p, margin, rank, ...
    CMP_POSITIONS = ("positions",)  # the positions the columns cover (None: all)
    CMP_KIND = ("kind",)  # full / topk / tokens
    CMP_MODE = ("mode",)
    CMP_STATUS = ("status",)
    CMP_FLIP_CLASSES = ("flip_classes",)  # forced: one class per entry of ``flips``
    CMP_FLIP_CLASS = ("flip_class",)  # free: the class of its flip (None: no flip)

    PRIMARY_DEFAULT = "primary"
    ROLES_REFERENCE = ("secondary", "reference")  # in order of preference, as compare.py
    OK_STATUSES = ("ok",)


def pick(rec: Mapping[str, Any] | None, names: Sequence[str], default: Any = None) -> Any:
    """The value of the first of ``names`` present (and not None) in ``rec``."""
    if not rec:
        return default
    for n in names:
        v = rec.get(n)
        if v is not None:
            return v
    return default


def _ids(v: Any) -> list[int] | None:
    if v is None or isinstance(v, (str, bytes)):
        return None
    try:
        return [int(t) for t in v]
    except (TypeError, ValueError):
        return None


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


def _choice_logprobs(turn: Mapping[str, Any], n: int) -> tuple[list | None, list[str] | None]:
    """Top-k entries and pieces from the proxy's ``choices[0].logprobs`` (text tokens give the
    pieces; ``token_id:N`` tokens give none)."""
    choices = pick(turn, F.TURN_CHOICES)
    ch = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], Mapping) else None
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
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.status in F.OK_STATUSES


@dataclass
class TurnRec:
    id: str
    session_id: str
    index: int
    created_ns: int
    primary: str
    prompt_ids: list[int] | None
    prompt_text: str | None
    messages: list | None
    reference: str | None
    state: str | None
    lane: Lane  # the primary's answer
    raw: dict = field(default_factory=dict, repr=False)


def primary_name(turn: Mapping[str, Any], backends: Mapping[str, Mapping[str, Any]] = {}) -> str:
    name = pick(turn, F.TURN_PRIMARY)
    if isinstance(name, str) and name:
        return name
    for b, info in backends.items():
        if pick(info, F.BACKEND_ROLE) == "primary":
            return b
    return F.PRIMARY_DEFAULT


def _prompt(turn: Mapping[str, Any]) -> tuple[list | None, str | None]:
    """(messages, prompt text) of the recorded request."""
    msgs = pick(turn, F.TURN_MESSAGES)
    text = pick(turn, F.TURN_PROMPT_TEXT)
    req = pick(turn, F.TURN_REQUEST)
    if isinstance(req, Mapping):
        if msgs is None:
            msgs = req.get("messages")
        system = req.get("system")  # Anthropic messages API
        if system and isinstance(msgs, list):
            msgs = [{"role": "system", "content": system}, *msgs]
        if text is None and isinstance(req.get("prompt"), str):
            text = req["prompt"]
    if text is None and isinstance(pick(turn, ("request_text",)), str):
        text = turn["request_text"]
    return (msgs if isinstance(msgs, list) else None), (text if isinstance(text, str) else None)


def turn_from_record(turn: Mapping[str, Any], backends: Mapping[str, Mapping[str, Any]] = {}) -> TurnRec:
    name = primary_name(turn, backends)
    ids = _ids(pick(turn, F.TURN_OUTPUT_IDS)) or []
    topk = _topk(pick(turn, F.TURN_TOPK))
    pieces = _strs(pick(turn, F.TURN_PIECES), len(ids))
    if topk is None or pieces is None:
        c_topk, c_pieces = _choice_logprobs(turn, len(ids))
        topk = topk if topk is not None else c_topk
        pieces = pieces if pieces is not None else c_pieces
    text = pick(turn, F.TURN_OUTPUT_TEXT)
    lane = Lane(
        backend=name,
        mode=RECORDED,
        run_id=None,
        token_ids=ids,
        pieces=pieces,
        text=text if isinstance(text, str) else None,
        topk=topk,
        tool_calls=pick(turn, F.TURN_TOOL_CALLS) or None,
        role="primary",
        created_ns=int(pick(turn, F.TURN_CREATED, 0) or 0),
        raw=dict(turn),
    )
    msgs, prompt_text = _prompt(turn)
    ref = pick(turn, F.TURN_REFERENCE)
    state = pick(turn, F.TURN_STATE)
    return TurnRec(
        id=str(turn.get("id")),
        session_id=str(turn.get("session_id")),
        index=int(pick(turn, F.TURN_INDEX, 0) or 0),
        created_ns=lane.created_ns,
        primary=name,
        prompt_ids=_ids(pick(turn, F.TURN_PROMPT_IDS)),
        prompt_text=prompt_text,
        messages=msgs,
        reference=ref if isinstance(ref, str) else None,
        state=state if isinstance(state, str) else None,
        lane=lane,
        raw=dict(turn),
    )


def lane_from_run(run: Mapping[str, Any], backends: Mapping[str, Mapping[str, Any]] = {}) -> Lane:
    backend = str(pick(run, F.RUN_BACKEND, "?"))
    ids = _ids(pick(run, F.RUN_IDS)) or []
    text = pick(run, F.RUN_TEXT)
    role = pick(run, F.RUN_ROLE) or pick(backends.get(backend), F.BACKEND_ROLE) or "shadow"
    positions = pick(run, F.RUN_POSITIONS)
    err = pick(run, F.RUN_ERROR)
    return Lane(
        backend=backend,
        mode=str(pick(run, F.RUN_MODE, FREE)),
        run_id=str(run.get("id")),
        token_ids=ids,
        pieces=_strs(pick(run, F.RUN_PIECES), len(ids)),
        text=text if isinstance(text, str) else None,
        topk=_topk(pick(run, F.RUN_TOPK)),
        tool_calls=pick(run, F.RUN_TOOL_CALLS) or None,
        status=str(pick(run, F.RUN_STATUS, "ok")),
        error=None if err is None else str(err),
        role=str(role),
        capture=pick(run, F.RUN_CAPTURE),
        positions=_ids(positions) if isinstance(positions, (list, tuple)) else None,
        created_ns=int(pick(run, ("created_ns",), 0) or 0),
        raw=dict(run),
    )


def comparison_flips(cmp: Mapping[str, Any]) -> int | None:
    """How many forced flips a comparison found (its ``flips`` list or count, or its summary's)."""
    flips = pick(cmp, F.CMP_FLIPS)
    if flips is None and isinstance(pick(cmp, F.CMP_SUMMARY), Mapping):
        flips = pick(pick(cmp, F.CMP_SUMMARY), F.CMP_FLIPS)
    if isinstance(flips, (list, tuple)):
        return len(flips)
    if isinstance(flips, (int, float)) and not isinstance(flips, bool):
        return int(flips)
    return None


def backend_infos(records: Iterable[Mapping[str, Any]]) -> dict[str, dict]:
    return {str(r.get("name")): dict(r) for r in records if r.get("name")}
