"""The typed records of the store: what each stored dict holds, field by field.

The store keeps records as JSON (a dict per record, `tensorverse.store.store`), so a writer may add
a field without a format change and a record written by an older Tensorverse still reads. Every
write is checked against these types before it is queued (:func:`checked`, in each
``Store.put_*``: a field not declared here, or of the wrong type, fails that write with
``RecordError``), and ``Store.put_*`` take the typed records as well as dicts. The types are also
how readers see the records: the store's reads (``Store.get_*``, ``Store.iter_*``) return them,
decoded by :func:`turn`, :func:`run`, :func:`comparison`, :func:`session` and :func:`backend`,
which check every field's type (``RecordError`` when a field has the wrong type). Fields a reader does not know are
ignored, so a newer writer's record still decodes; fields a record lacks take the defaults below.
Old field names are rewritten once, by the store's migrations (`tensorverse.store.schema`), never
guessed by readers.

Nested parts whose shape belongs to another module stay plain JSON values, typed ``dict`` or
``list``: a turn's ``request`` (the client's body), ``choices`` (`tensorverse.store.turns`), a
run's ``rows`` and ``sampling``, a comparison's ``metrics`` columns and ``summary``.

Who writes them: the proxy's recorder (turns) and session grouping (sessions), the shadow runner
(runs, backends), `tensorverse.shadow.compare` (comparisons), ``tensorverse replay`` (sessions,
turns, runs and comparisons of its cases). docs/architecture.md, "Records", has the overview.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Literal, Mapping, TypeVar

import msgspec

from tensorverse.refusal import Refusal

__all__ = ["Record", "Session", "Turn", "Run", "Comparison", "ComparisonBase", "ForcedComparison", "FreeComparison",
           "comparison_type", "BackendInfo", "RecordError", "session", "turn", "run",
           "comparison", "backend", "compaction", "Compaction", "CompactedRun", "decode", "at_default", "unknown_fields", "checked", "KINDS", "RECORD_TYPES", "record_type", "RECORDED", "FORCED", "FREE"]

# modes of a run
RECORDED = "recorded"  # the primary's own answer, as the shadow runner stores it
FORCED = "forced"
FREE = "free"


class RecordError(Refusal):
    """A record that does not fit its type. ``reason``: ``type`` (a field of the wrong type, or a
    required one missing), ``untyped`` (a stored record with fields its type does not declare:
    what `unknown_fields` finds), ``kind`` (a write of anything but its typed record: a dict, or a
    record of another kind), ``mode`` (a comparison of an unknown mode)."""

    REASONS = ("type", "untyped", "kind", "mode")


class Record(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What every stored record type is."""


class Session(Record, kw_only=True):
    """A conversation (`tensorverse.proxy.sessions`); the counters and ``edits`` are the store's."""

    id: str
    created_ns: int = 0
    tags: dict[str, Any] = {}
    grouping: str | None = None  # how its first turn was grouped: header, client_id, prefix
    endpoint: str | None = None
    turns: int = 0  # one past the highest turn index
    side_turns: int = 0
    tool_call_turns: int = 0
    updated_ns: int | None = None
    edits: list[dict[str, Any]] = []  # merges, splits and moves, by hand or by the proxy
    pinned: bool = False  # `tensorverse store pin`: never pruned by retention
    split_from: str | None = None  # the session a `tensorverse sessions split` made this one from


class Turn(Record, kw_only=True):
    """One LLM request of a session and the primary's answer (`tensorverse.proxy.recorder`)."""

    id: str
    session_id: str | None = None  # None only for a turn that is not stored (a replay case's)
    index: int = 0
    created_ns: int = 0
    endpoint: str | None = None  # chat.completions, completions, responses, messages
    method: str | None = None
    path: str | None = None
    backend: str | None = None  # the backend whose answer this is (the primary's name)
    request_headers: dict[str, str] = {}
    state: str | None = None  # ok, upstream_error, aborted, error
    status: int | None = None
    error: str | None = None
    timings: dict[str, Any] = {}
    injected: dict[str, Any] = {}
    retried_without_injection: bool = False
    kind: str = "main"  # main, or side (a title, a compaction summary...)
    grouping: dict[str, Any] | None = None
    request: dict[str, Any] | None = None  # the client's body (None when it was not JSON)
    request_unparsed: bool = False
    request_parse_error: str | None = None
    request_text: str | None = None
    model: str | None = None
    stream: bool = False
    tools_offered: bool = False
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    choices: list[dict[str, Any]] = []  # canonical logprobs: `tensorverse.store.turns`
    text: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = []  # None: not parsed (a replay case's basis)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    response_id: str | None = None
    events: int | None = None  # how many stream events the answer had (None: not streamed)
    response_text: str | None = None
    response_unparsed: bool = False
    unparsed_events: int = 0
    stream_tail: str | None = None
    incomplete: bool = False
    # written by ``tensorverse replay`` for its cases
    sampling: dict[str, Any] | None = None
    reference: str | None = None
    # written by the store
    index_requested: int | None = None
    moved_from: list[dict[str, Any]] = []
    # optional, from writers that have them: per-position top-k (any form
    # `tensorverse.analysis.topk.parse_top_logprobs` reads), the decoded text of each output
    # token, and {token id: text} for ids beyond the turn's own tokens
    top_logprobs: list[Any] | None = None
    pieces: list[str | None] | None = None
    token_texts: dict[str, str] | None = None


class Run(Record, kw_only=True):
    """One backend's run of one turn in one mode (`tensorverse.shadow.runner`); ``id`` is the
    capture id of its rows. The primary's own answer is a ``recorded`` run."""

    id: str
    turn_id: str
    session_id: str | None = None
    backend: str
    role: str | None = None  # primary, secondary, reference, shadow
    mode: str  # recorded, forced, free
    status: str = "ok"  # ok, failed, timeout, refused
    capture: str | None = None  # full (rows in the store), topk, none
    approximate: bool = False
    method: str | None = None  # forced_decode, prompt_logprobs, generate, recorded
    token_ids: list[int] = []
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    top_logprobs: list[Any] | None = None  # per position [[id, logprob], ...], best first
    token_logprobs: list[float | None] | None = None
    k: int | None = None
    rows: dict[str, Any] | None = None  # expected, present, complete, waited_s, missing
    # evidence chosen at the source (tensorverse.shadow.evidence): k, close_nats, requested
    evidence: dict[str, Any] | None = None
    timings: dict[str, Any] = {}
    sampling: dict[str, Any] | None = None  # what was sent, without the prompt
    prompt_tokens: int | None = None
    attempts: list[dict[str, Any]] = []
    retries: int = 0  # ``tensorverse replay``: how many more tries the run took (failed, timed out)
    error: str | None = None
    tokenizer: dict[str, Any] | None = None  # the same-dictionary check
    template: dict[str, Any] | None = None  # the chat-template check
    created_ns: int = 0
    # recorded runs: the primary's pieces, tool calls and parser check
    pieces: list[str | None] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    parser_check: dict[str, Any] | None = None
    # optional: positions with stored rows, when a writer lists them; {token id: text}
    positions: list[int] | None = None
    token_texts: dict[str, str] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class ComparisonBase(Record, kw_only=True):
    """What every comparison holds: a candidate run against a reference run
    (`tensorverse.shadow.compare`, whose docstring says what each result field means). A stored
    comparison is a :class:`ForcedComparison` or a :class:`FreeComparison`, told apart by
    ``mode``; :data:`Comparison` is either."""

    run_id: str
    ref_run_id: str
    turn_id: str | None = None
    mode: str
    kind: str | None = None  # forced: full / topk; free: tokens
    backend: str | None = None
    ref_backend: str | None = None
    role: str | None = None
    ref_role: str | None = None
    status: str = "ok"  # ok, error
    error: str | None = None
    approximate: bool = False
    noise_floor: bool = False
    template_mismatch: bool = False
    first_flip: int | None = None
    flips_by_class: dict[str, int] | None = None
    attribution: dict[str, Any] | None = None


class ForcedComparison(ComparisonBase, kw_only=True):
    """Both runs scored on the primary's tokens: per-position metrics, flips and their classes."""

    mode: Literal["forced"] = "forced"
    n: int | None = None
    positions: list[int] | None = None  # the positions the metric columns cover (None: all)
    # positions whose metrics came from compact rows (reduced at the source): KL a lower bound
    compact_positions: list[int] | None = None
    incomplete: bool = False
    summary: dict[str, Any] | None = None
    flips: list[int] | None = None
    flip_tokens: list[dict[str, Any]] | None = None
    metrics: dict[str, Any] | None = None  # per-position columns (lists): kl, delta_p, margin, rank...
    regions: list[Any] | None = None
    noise: dict[str, Any] | None = None
    flip_classes: list[str] | None = None  # one class per entry of ``flips``
    excess: dict[str, Any] | None = None


class FreeComparison(ComparisonBase, kw_only=True):
    """The candidate's own answer against the primary's: where they diverge, the tool calls."""

    mode: Literal["free"] = "free"
    divergence: dict[str, Any] | None = None
    diverged: bool | None = None
    common_prefix: int | None = None
    region: str | None = None  # of the primary's output at the divergence (None: no pieces, no divergence)
    flip_class: str | None = None
    tool_calls: dict[str, Any] | None = None
    verdict: str | None = None
    ref_tool_calls: int | None = None
    cand_tool_calls: int | None = None
    forced_departure: int | None = None
    confirms_forced: bool | None = None
    finish_reason: str | None = None
    ref_finish_reason: str | None = None


Comparison = ForcedComparison | FreeComparison


def comparison_type(record: Mapping[str, Any] | ComparisonBase) -> type[ForcedComparison] | type[FreeComparison]:
    """The class of a comparison, by its ``mode`` (``forced`` when it has none: the default of
    the records written before free comparisons existed)."""
    if isinstance(record, (ForcedComparison, FreeComparison)):
        return type(record)
    mode = record.get("mode", FORCED) if isinstance(record, Mapping) else record.mode
    if mode == FREE:
        return FreeComparison
    if mode == FORCED:
        return ForcedComparison
    raise RecordError(f"comparison of {record.get('run_id') if isinstance(record, Mapping) else record.run_id!r}: "
                      f"unknown mode {mode!r} (forced, free)", "mode")


class BackendInfo(Record, kw_only=True):
    """A backend as the proxy (at start) and the shadow runner (once it ran one) register it:
    never its key or its headers' values."""

    name: str
    url: str | None = None
    role: str | None = None
    model: str | None = None
    capture: str | None = None  # full, topk, auto
    settings: dict[str, Any] = {}  # what differs from the primary (the proxy's config)
    timeout_s: float | None = None
    concurrency: int | None = None
    logprobs: int | None = None
    captured_logprobs: int | None = None
    has_api_key: bool = False
    tokenizer: dict[str, Any] | None = None  # fingerprint, vocab_size, template_fingerprint
    capabilities: dict[str, Any] | None = None  # forcing, capture, detail (probed)


class CompactedRun(Record, kw_only=True):
    """What compaction kept of one run of a turn: the positions kept in full (``full``), those
    re-encoded as deltas against ``delta_ref``'s rows (``delta``), how many became compact rows,
    and their top-k."""

    backend: str | None = None
    mode: str | None = None
    full: list[int] = []
    delta: list[int] = []
    delta_ref: str | None = None
    compact: int = 0
    topk: int | None = None


class Compaction(Record, kw_only=True):
    """What compaction kept of a turn and why (`tensorverse.store.compaction`; the store's
    ``compacted`` table, one per turn): per run, the positions kept; per position, why
    (``reasons`` for the forced runs, ``free_reasons`` by free run id; positions as strings,
    JSON's keys); the row bytes before and after. Retention, deleting a session's rows, writes
    one for each of its turns, with ``rows_pruned`` (when)."""

    turn_id: str
    at_ns: int = 0
    policy: dict[str, Any] = {}  # the `[retention]` evidence policy it ran with
    reference_run: str | None = None
    runs: dict[str, CompactedRun] = {}
    reasons: dict[str, list[str]] = {}
    free_reasons: dict[str, dict[str, list[str]]] = {}
    bytes_before: int = 0
    bytes_after: int = 0
    rows_pruned: int | None = None

    def reasons_at(self, run_id: str, position: int) -> list[str]:
        """Why ``position`` of ``run_id`` was kept in full ([] if it was not; a run the record
        does not list reads as a forced one)."""
        run = self.runs.get(run_id)
        if run is not None and run.mode == FREE:
            return list(self.free_reasons.get(run_id, {}).get(str(position), []))
        return list(self.reasons.get(str(position), []))


#: the store's kinds of record (``Store.records(kind)``)
KINDS = ("session", "turn", "run", "comparison", "backend")
RECORD_TYPES: dict[str, type[Record]] = {"session": Session, "turn": Turn, "run": Run, "backend": BackendInfo}


def record_type(kind: str, record: Mapping[str, Any]) -> type[Record]:
    """The type of a stored record of ``kind`` (a comparison's depends on its mode)."""
    if kind == "comparison":
        return comparison_type(record)
    try:
        return RECORD_TYPES[kind]
    except KeyError:
        raise ValueError(f"unknown record kind {kind!r} (one of {', '.join(KINDS)})") from None

R = TypeVar("R", bound=Record)


def decode(record: Mapping[str, Any] | R, cls: type[R], *, strict: bool = False) -> R:
    """``record`` (a stored dict) as ``cls``; a record already of that type is returned as is.
    A read is lax (``strict`` False): a number or a flag a writer stored as text reads as its
    value; a write's check is strict (:func:`checked`)."""
    if isinstance(record, cls):
        return record
    try:
        return msgspec.convert(record, cls, strict=strict)
    except msgspec.ValidationError as e:
        rid = record.get("id") if isinstance(record, Mapping) else None
        raise RecordError(f"{cls.__name__.lower()} {rid!r}: {e}", "type") from None


def session(record: Mapping[str, Any] | Session) -> Session:
    return decode(record, Session)


def turn(record: Mapping[str, Any] | Turn) -> Turn:
    return decode(record, Turn)


def run(record: Mapping[str, Any] | Run) -> Run:
    return decode(record, Run)


def comparison(record: Mapping[str, Any] | Comparison) -> Comparison:
    """A stored comparison as a :class:`ForcedComparison` or a :class:`FreeComparison`."""
    return decode(record, comparison_type(record))


def backend(record: Mapping[str, Any] | BackendInfo) -> BackendInfo:
    return decode(record, BackendInfo)


def compaction(record: Mapping[str, Any] | Compaction) -> Compaction:
    return decode(record, Compaction)


@functools.cache
def _defaults(cls: type[Record]) -> dict[str, Any]:
    """``{field: its declared default}`` for the fields of ``cls`` that have one, read once a
    class (``msgspec.structs.fields`` resolves the annotations on every call). Only compared
    with, never handed out, so a factory's value is made once."""
    return {f.name: f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
            for f in msgspec.structs.fields(cls)
            if f.default_factory is not msgspec.NODEFAULT or f.default is not msgspec.NODEFAULT}


def at_default(record: Record, names: Iterable[str]) -> set[str]:
    """The fields among ``names`` that ``record`` holds at their declared default."""
    defaults = _defaults(type(record))
    return {name for name in names if name in defaults and getattr(record, name) == defaults[name]}


def unknown_fields(record: Mapping[str, Any], cls: type[Record]) -> list[str]:
    """The fields of ``record`` that ``cls`` does not declare (a writer that forgot to type one)."""
    return sorted(set(record) - set(cls.__struct_fields__))


def checked(record: Record, cls: type[Record], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The dict a write stores for ``record``, checked against ``cls`` on the caller's thread,
    before the write is queued. Writes take typed records only: anything else, a dict included,
    is refused (:class:`RecordError`, ``kind``), as is a record of another type. The dict holds
    every field (the defaults written out, as a reader would fill them in); a field of
    ``defaults`` that ``record`` holds at its declared default takes the value given there (a
    write's time: ``created_ns`` 0 means "not set", never 1970). Every value is then checked
    against its type (``type``): a struct's constructor does not check types, so a wrong one
    fails the write that makes it instead of the reader that meets it."""
    if not isinstance(record, cls):
        raise RecordError(f"a {type(record).__name__} stored as a {cls.__name__}: "
                          f"writes take the typed records of tensorverse.store.records", "kind")
    # every field (the records omit their defaults when encoded), values as they are:
    # builtins, or JSON text kept unparsed (`tensorverse.jsonbytes.RawJSON`: parts of the
    # upstream's answer in a recorded turn), which the store's encoder writes as it is
    out: dict[str, Any] = msgspec.structs.asdict(record)
    if defaults:
        for name in at_default(record, defaults):
            out[name] = defaults[name]
    decode(out, cls, strict=True)  # a number given as text is a wrong type here
    return out
