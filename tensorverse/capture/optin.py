"""How a request opts in to capture and forcing: ``vllm_xargs`` keys and their checks.

A request opts in through ``vllm_xargs`` in its body (vLLM copies it into
``SamplingParams.extra_args``; values may be strings, ints, floats, or lists of them):

``tv_capture``  (str)
    Capture id: the run id rows are stored under. 1..256 characters, no control characters.
    One request per capture id: two requests with the same id overwrite each other's rows.
``tv_force``  (list[int], or a string of ids separated by commas/spaces: ``"151644,872,198"``)
    Teacher forcing: at output position *i* the row is masked so token ``tv_force[i]`` is
    sampled. Positions past the end of the list decode freely.
``tv_positions``  (str or list[int]; default: every position)
    Which output positions to capture: a list of positions, ``"all"``, ``"every:N"``
    (0, N, 2N, ...), ``"every:N+K"`` (K, K+N, ...), or ranges ``"0-15,20,64-"``
    (inclusive; ``"64-"`` is open-ended).
``tv_compact``  (int, 1..4096)
    Evidence chosen at the source (:mod:`tensorverse.capture.reduce`): each captured row travels
    as its compact form with this many top logits, unless it is evidence (a forced row whose top-1
    is not the forced token, a close call, a requested position, ...), which travels in full.
    Without it every captured row travels in full.
``tv_close``  (float >= 0, nats; default 0.1; needs ``tv_compact``)
    A row whose top-2 logit gap is below this is a close call and travels in full.
``tv_full``  (positions, as ``tv_positions``; needs ``tv_compact``)
    Positions whose rows travel in full whatever they hold (the proxy's requests).

The sink is never chosen by a request: it is configured on the server (see
:mod:`tensorverse.capture.runtime`).

Rejected with HTTP 400 (``validate_params``) because they would change the row before the plugin
copies it, or fight the forcing: ``n > 1`` (children share the capture id), ``logit_bias``,
``allowed_token_ids``, ``bad_words``, structured outputs, ``min_tokens`` with capture,
penalties with capture (Model Runner V2 applies them before custom processors), and
``thinking_token_budget`` with forcing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

__all__ = ["KEY_CAPTURE", "KEY_FORCE", "KEY_POSITIONS", "KEY_COMPACT", "KEY_CLOSE", "KEY_FULL", "OptInError", "Positions", "OptIn", "EvidenceSpec",
           "parse_extra_args", "check_sampling_params", "MAX_CAPTURE_ID_CHARS"]

KEY_CAPTURE = "tv_capture"
KEY_FORCE = "tv_force"
KEY_POSITIONS = "tv_positions"
KEY_COMPACT = "tv_compact"
KEY_CLOSE = "tv_close"
KEY_FULL = "tv_full"
KEYS = (KEY_CAPTURE, KEY_FORCE, KEY_POSITIONS, KEY_COMPACT, KEY_CLOSE, KEY_FULL)
MAX_COMPACT_K = 4096
DEFAULT_CLOSE_NATS = 0.1
MAX_CAPTURE_ID_CHARS = 256
MAX_POSITION = (1 << 31) - 1
MAX_TOKEN_ID = (1 << 31) - 1

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SPLIT = re.compile(r"[,\s]+")


class EvidenceSpec(NamedTuple):
    """What a request asked of one captured row with ``tv_compact`` (see
    :mod:`tensorverse.capture.reduce`, which decides)."""

    k: int  # logits kept in the compact form
    close_nats: float  # top-2 gap under which the row travels in full
    forced: int  # the forced token at this position, -1 when the position decodes freely
    requested: bool  # the proxy asked for this position in full


class OptInError(ValueError):
    """An invalid ``tv_*`` key in ``vllm_xargs`` (becomes HTTP 400 in vLLM)."""


@dataclass(frozen=True, slots=True)
class Positions:
    """A set of output positions: everything, an arithmetic progression, or explicit ranges."""

    every: int = 1  # > 0: progression offset, offset+every, ...; 0: use ranges
    offset: int = 0
    ranges: tuple[tuple[int, int], ...] = ()  # inclusive (lo, hi); hi = -1 means open-ended

    def __contains__(self, p: int) -> bool:
        if self.every:
            return p >= self.offset and (p - self.offset) % self.every == 0
        for lo, hi in self.ranges:
            if p >= lo and (hi < 0 or p <= hi):
                return True
        return False

    @property
    def is_all(self) -> bool:
        return self.every == 1 and self.offset == 0

    def last(self) -> int | None:
        """The largest position in the set, or None when it is unbounded."""
        if self.every or any(hi < 0 for _, hi in self.ranges):
            return None
        return max((hi for _, hi in self.ranges), default=-1)

    @classmethod
    def parse(cls, value: Any, key: str = KEY_POSITIONS) -> "Positions":
        if value is None:
            return ALL
        if isinstance(value, (list, tuple)):
            if not value:
                raise OptInError(f"{key}: empty list")
            ps = sorted({_int(v, key, MAX_POSITION) for v in value})
            return cls(every=0, ranges=_merge([(p, p) for p in ps]))
        if not isinstance(value, str):
            raise OptInError(f"{key} must be a string or a list of ints, "
                             f"got {type(value).__name__}")
        spec = value.strip().lower()
        if spec == "all":
            return ALL
        m = re.fullmatch(r"every:(\d+)(?:\+(\d+))?", spec)
        if m:
            every, offset = int(m.group(1)), int(m.group(2) or 0)
            if every < 1 or every > MAX_POSITION or offset > MAX_POSITION:
                raise OptInError(f"{key}: bad progression {value!r}")
            return cls(every=every, offset=offset)
        ranges = []
        for part in spec.split(","):
            part = part.strip()
            m = re.fullmatch(r"(\d+)(?:-(\d*))?", part)
            if not m:
                raise OptInError(
                    f"{key}: cannot read {value!r}; use a list of positions, 'all', "
                    "'every:N', 'every:N+K', or ranges like '0-15,20,64-'")
            lo = int(m.group(1))
            hi = lo if m.group(2) is None else (-1 if m.group(2) == "" else int(m.group(2)))
            if lo > MAX_POSITION or hi > MAX_POSITION or (hi >= 0 and hi < lo):
                raise OptInError(f"{key}: bad range {part!r}")
            ranges.append((lo, hi))
        return cls(every=0, ranges=_merge(ranges))


ALL = Positions()


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out:
            plo, phi = out[-1]
            if phi < 0:
                continue
            if lo <= phi + 1:
                out[-1] = (plo, -1 if hi < 0 else max(phi, hi))
                continue
        out.append((lo, hi))
    return tuple(out)


def _int(v: Any, key: str, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        elif isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        else:
            raise OptInError(f"{key}: {v!r} is not a non-negative integer")
    if not 0 <= v <= hi:
        raise OptInError(f"{key}: {v} out of range 0..{hi}")
    return v


@dataclass(frozen=True, slots=True)
class OptIn:
    """What one request asked for."""

    capture_id: str | None
    force: tuple[int, ...] | None
    positions: Positions = ALL
    compact: int | None = None  # tv_compact: top-k of the compact form; None: every row in full
    close_nats: float = DEFAULT_CLOSE_NATS
    full: Positions | None = None  # tv_full

    def captures(self, position: int) -> bool:
        return self.capture_id is not None and position in self.positions

    def forced_token(self, position: int) -> int | None:
        f = self.force
        return f[position] if f is not None and position < len(f) else None

    def evidence(self, position: int) -> EvidenceSpec | None:
        """What the tap decides for the row of ``position`` (None: send it in full)."""
        if self.compact is None:
            return None
        forced = self.forced_token(position)
        return EvidenceSpec(self.compact, self.close_nats, -1 if forced is None else forced,
                            self.full is not None and position in self.full)

    def finished_at(self, position: int) -> bool:
        """True when nothing is left to do at ``position`` or later."""
        if self.force is not None and position < len(self.force):
            return False
        if self.capture_id is None:
            return True
        last = self.positions.last()
        return last is not None and position > last


def parse_extra_args(extra_args: Mapping[str, Any] | None) -> OptIn | None:
    """The request's opt-in, or None when it has no ``tv_*`` key. Raises :class:`OptInError`."""
    if not extra_args:
        return None
    if KEY_CAPTURE not in extra_args and KEY_FORCE not in extra_args:
        if KEY_POSITIONS in extra_args:
            raise OptInError(f"{KEY_POSITIONS} needs {KEY_CAPTURE}")
        return None
    capture_id = extra_args.get(KEY_CAPTURE)
    if capture_id is not None:
        if not isinstance(capture_id, str) or not capture_id.strip():
            raise OptInError(f"{KEY_CAPTURE} must be a non-empty string, got {capture_id!r}")
        if len(capture_id) > MAX_CAPTURE_ID_CHARS or _CONTROL.search(capture_id):
            raise OptInError(f"{KEY_CAPTURE} must be at most {MAX_CAPTURE_ID_CHARS} characters "
                             "without control characters")
    force = extra_args.get(KEY_FORCE)
    if force is not None:
        if isinstance(force, str):
            parts = [p for p in _SPLIT.split(force.strip()) if p]
        elif isinstance(force, (list, tuple)):
            parts = list(force)
        elif isinstance(force, int) and not isinstance(force, bool):
            parts = [force]
        else:
            raise OptInError(f"{KEY_FORCE} must be a list of token ids or a string of ids, "
                             f"got {type(force).__name__}")
        if not parts:
            raise OptInError(f"{KEY_FORCE}: empty")
        force = tuple(_int(p, KEY_FORCE, MAX_TOKEN_ID) for p in parts)
    positions = Positions.parse(extra_args.get(KEY_POSITIONS))
    if capture_id is None and KEY_POSITIONS in extra_args:
        raise OptInError(f"{KEY_POSITIONS} needs {KEY_CAPTURE}")
    compact, close, full = None, DEFAULT_CLOSE_NATS, None
    if KEY_COMPACT in extra_args:
        if capture_id is None:
            raise OptInError(f"{KEY_COMPACT} needs {KEY_CAPTURE}")
        compact = _int(extra_args[KEY_COMPACT], KEY_COMPACT, MAX_COMPACT_K)
        if compact < 1:
            raise OptInError(f"{KEY_COMPACT}: {compact} out of range 1..{MAX_COMPACT_K}")
    for key in (KEY_CLOSE, KEY_FULL):
        if key in extra_args and compact is None:
            raise OptInError(f"{key} needs {KEY_COMPACT}")
    if KEY_CLOSE in extra_args:
        close = _nats(extra_args[KEY_CLOSE], KEY_CLOSE)
    if KEY_FULL in extra_args:
        full = Positions.parse(extra_args[KEY_FULL], KEY_FULL)
    return OptIn(capture_id, force, positions, compact, close, full)


def _nats(v: Any, key: str) -> float:
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise OptInError(f"{key}: {v!r} is not a number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise OptInError(f"{key}: {v!r} is not a finite number >= 0")
    return float(v)


def check_sampling_params(params: Any) -> OptIn | None:
    """Parse and check a request's opt-in against the rest of its sampling params.

    Raises :class:`OptInError` (a ``ValueError``: vLLM answers HTTP 400) when the request asks
    for something the plugin cannot honour exactly.
    """
    opt = parse_extra_args(getattr(params, "extra_args", None))
    if opt is None:
        return None
    problems = []
    if (getattr(params, "n", 1) or 1) != 1:
        problems.append("n must be 1 (every sequence of a request would share one capture id)")
    if getattr(params, "logit_bias", None):
        problems.append("logit_bias changes the row before capture")
    if getattr(params, "allowed_token_ids", None):
        problems.append("allowed_token_ids masks the row before capture")
    if getattr(params, "bad_words", None):
        problems.append("bad_words masks the row before capture")
    if getattr(params, "structured_outputs", None) is not None:
        problems.append("structured outputs mask the row before capture")
    if opt.capture_id is not None:
        if getattr(params, "min_tokens", 0):
            problems.append("min_tokens masks stop tokens in the row before capture")
        if (getattr(params, "presence_penalty", 0.0) or 0.0) != 0.0 or \
                (getattr(params, "frequency_penalty", 0.0) or 0.0) != 0.0 or \
                (getattr(params, "repetition_penalty", 1.0) or 1.0) != 1.0:
            problems.append("penalties change the row before capture on Model Runner V2 "
                            "(send presence_penalty=0, frequency_penalty=0, repetition_penalty=1)")
    if opt.force is not None and getattr(params, "thinking_token_budget", None) is not None:
        problems.append("thinking_token_budget would override forced tokens")
    if problems:
        raise OptInError("tensorverse capture: " + "; ".join(problems))
    return opt
