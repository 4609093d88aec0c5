"""Tool-call extraction and comparison (the *tool-call verdict*; docs/architecture.md).

Extraction understands the three formats a vLLM-served agent meets:

* **qwen3_json** — Qwen3 / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  possibly several, possibly after a ``<think>...</think>`` block. ``arguments`` may also be a
  JSON *string* holding the object (it is decoded); ``parameters`` is accepted as an alias.
* **qwen3_coder_xml** — Qwen3-Coder:
  ``<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>``. Each value
  loses one leading and one trailing newline (as vLLM's ``qwen3_coder`` parser does), then is
  JSON-decoded when that works (``201`` -> 201, ``{"a": 1}`` -> dict, ``true`` -> True) and kept
  as a string otherwise. A bare ``<function=...>`` without ``<tool_call>`` is accepted when the
  text holds no ``<tool_call>`` at all (as vLLM does).
* **openai** — a response message's ``tool_calls`` list
  (``[{"id", "type": "function", "function": {"name", "arguments": "<json>"}}]``), with
  ``arguments`` either a JSON string or an already-decoded dict; ``{"name", "arguments"}`` items
  and objects with ``model_dump()`` (the ``openai`` SDK's types) are accepted too.

Nothing here raises on model output: whatever cannot be parsed becomes a :class:`Malformed` entry
(``unclosed_tag``, ``invalid_json``, ``trailing_data``, ``not_an_object``, ``missing_name``,
``invalid_arguments``, ``invalid_xml``, ``stray_close_tag``, ``invalid_entry``).

Decisions (documented here, tested in ``tests/analysis/test_toolcalls.py``):

* Thinking is removed before parsing, as vLLM's reasoning parser does before the tool parser:
  ``<think>...</think>`` blocks are dropped; a ``</think>`` with no ``<think>`` before it (the
  template pre-filled ``<think>``) drops everything up to it; an unclosed ``<think>`` drops
  everything after it. Tool calls written *inside* thinking are not calls.
* A ``<tool_call>`` that is never closed is malformed, unless it runs to the end of the text and
  its body is nonetheless a complete, valid call (the model was stopped right before
  ``</tool_call>``); vLLM's parsers accept that case, so the agent received a valid call, and so
  do we. A truncated ``<tool_call>{"name": "show_vlan", "argu`` is malformed (invalid JSON).
  For XML, a ``<function=`` without ``</function>`` is malformed (truncated); a parameter without
  ``</parameter>`` but followed by another ``<parameter=`` or ``</function>`` is accepted (vLLM).
* Missing or ``null`` ``arguments`` is an empty argument object.
* A ``</tool_call>`` with no ``<tool_call>`` before it is a ``stray_close_tag`` entry and is not
  part of the content.

Comparison (:func:`compare_tool_calls`) follows BFCL's AST checker:

* Parallel calls are matched regardless of order: the assignment minimises the total cost
  (0 = identical; same name costs the number of differences; a different name costs 1000), brute
  force over permutations when that is small (<= 50,000 assignments, ties to the first), exactly
  by scipy's linear_sum_assignment otherwise.
* Values are type-aware: numbers compare numerically, so ``1 == 1.0`` (BFCL accepts an int where
  a float is expected; a token flip rarely turns ``1`` into ``1.0``), but booleans are not numbers
  (``True != 1``), and ``"1" != 1``. Strings are exact: case-sensitive, no whitespace trimming
  (``GigabitEthernet0/0/1.201 != GigabitEthernet0/1/4``). Lists are ordered and compared element
  by element when their lengths agree (a length difference is one ``value_mismatch`` on the whole
  list). Nested objects recurse; a key missing or extra *inside* a nested value is a
  ``value_mismatch`` at that key's path (``missing_param`` / ``unexpected_param`` are top-level
  arguments only, as in BFCL). Two NaNs are equal.
* When names differ, arguments are not compared (one ``wrong_func_name`` difference).
* Paths: ``$.name``, ``$.arguments.interface`` when both sides hold exactly one call, otherwise
  ``$[i]...`` with ``i`` the *reference* call's index (``$[1].arguments.vlans[2]``). Keys that are
  not identifiers are written ``["key with space"]``. A count mismatch adds one difference at
  ``$`` (both counts) and one per unmatched call (``$[i]`` on the side that has it).
* The verdict is the most severe difference, in the order of :data:`SEVERITY` (``malformed`` first).
  Both sides without calls (and nothing malformed) is a ``match``.
* In :meth:`Difference.to_dict`, a value that does not exist on one side (a missing parameter, an
  unmatched call) has no ``reference`` / ``candidate`` key at all; ``None`` means JSON ``null``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorverse.analysis.regions import NextFinder

__all__ = [
    "FORMATS",
    "SEVERITY",
    "VERDICTS",
    "Difference",
    "Extraction",
    "Malformed",
    "ToolCall",
    "Verdict",
    "compare_tool_calls",
    "extract_tool_calls",
]

#: Verdicts from most to least severe; the overall verdict is the first one present.
SEVERITY: tuple[str, ...] = (
    "malformed",
    "count_mismatch",
    "wrong_func_name",
    "missing_param",
    "unexpected_param",
    "value_mismatch",
    "match",
)
VERDICTS = SEVERITY
FORMATS: tuple[str, ...] = ("none", "qwen3_json", "qwen3_coder_xml", "openai", "mixed")

_TC_OPEN = "<tool_call>"
_TC_CLOSE = "</tool_call>"
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_FN_OPEN = "<function="
_FN_CLOSE = "</function>"
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_DECODER = json.JSONDecoder()


class _Missing:
    """Sentinel: the value does not exist on that side (distinct from JSON null)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()


# --------------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    """One parsed call. ``raw`` is the text (or JSON of the entry) it came from."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""
    format: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "raw": self.raw, "format": self.format}


@dataclass
class Malformed:
    """A piece that looks like a tool call but cannot be parsed."""

    reason: str
    raw: str
    format: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "raw": self.raw, "format": self.format, "detail": self.detail}


@dataclass
class Extraction:
    """Everything extracted from one branch's output."""

    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    format: str = "none"
    content: str = ""
    reasoning: str | None = None

    @property
    def ok(self) -> bool:
        return not self.malformed

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "calls": [c.to_dict() for c in self.calls],
            "malformed": [m.to_dict() for m in self.malformed],
            "content": self.content,
            "reasoning": self.reasoning,
        }


@dataclass
class Difference:
    """One typed difference between reference and candidate calls."""

    kind: str
    path: str
    call_index: int | None = None
    candidate_index: int | None = None
    reference: Any = MISSING
    candidate: Any = MISSING
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind,
            "path": self.path,
            "call_index": self.call_index,
            "candidate_index": self.candidate_index,
        }
        if self.reference is not MISSING:
            d["reference"] = _jsonable(self.reference)
        if self.candidate is not MISSING:
            d["candidate"] = _jsonable(self.candidate)
        d["detail"] = self.detail
        return d


@dataclass
class Verdict:
    """The comparison result. ``pairs`` holds (reference index, candidate index) assignments."""

    verdict: str
    differences: list[Difference] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)
    n_reference: int = 0
    n_candidate: int = 0

    @property
    def match(self) -> bool:
        return self.verdict == "match"

    def kinds(self) -> list[str]:
        return [d.kind for d in self.differences]

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "n_reference": self.n_reference,
            "n_candidate": self.n_candidate,
            "pairs": [list(p) for p in self.pairs],
            "differences": [d.to_dict() for d in self.differences],
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, ToolCall):
        return {"name": value.name, "arguments": value.arguments}
    return value


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------


def _split_thinking(text: str) -> tuple[str, str | None]:
    """Return (visible text, reasoning text or None)."""
    reasoning: list[str] = []
    close = text.find(_THINK_CLOSE)
    open_ = text.find(_THINK_OPEN)
    if close != -1 and (open_ == -1 or close < open_):
        reasoning.append(text[:close])
        text = text[close + len(_THINK_CLOSE) :]
    out: list[str] = []
    i = 0
    while True:
        j = text.find(_THINK_OPEN, i)
        if j == -1:
            out.append(text[i:])
            break
        out.append(text[i:j])
        k = text.find(_THINK_CLOSE, j + len(_THINK_OPEN))
        if k == -1:
            reasoning.append(text[j + len(_THINK_OPEN) :])
            break
        reasoning.append(text[j + len(_THINK_OPEN) : k])
        i = k + len(_THINK_CLOSE)
    return "".join(out), ("".join(reasoning) if reasoning else None)


def _decode_json_value(s: str) -> Any:
    """JSON-decode a whole string; raise ValueError on failure (incl. trailing data)."""
    s2 = s.strip()
    obj, end = _DECODER.raw_decode(s2)
    if end != len(s2):
        raise ValueError("trailing data")
    return obj


def _normalise_arguments(args: Any) -> tuple[dict[str, Any] | None, str]:
    """Return (arguments dict, error detail)."""
    if args is None or args is MISSING:
        return {}, ""
    if isinstance(args, str):
        if not args.strip():
            return {}, ""
        try:
            args = _decode_json_value(args)
        except (ValueError, RecursionError) as exc:
            return None, f"arguments string is not JSON: {exc}"
    if isinstance(args, Mapping):
        return {str(k): v for k, v in args.items()}, ""
    return None, f"arguments is a {type(args).__name__}, not an object"


def _parse_json_call(body: str, raw: str) -> ToolCall | Malformed:
    fmt = "qwen3_json"
    stripped = body.strip()
    if not stripped:
        return Malformed("invalid_json", raw, fmt, "empty tool call")
    try:
        obj, end = _DECODER.raw_decode(stripped)
    except json.JSONDecodeError as exc:
        return Malformed("invalid_json", raw, fmt, str(exc))
    except (ValueError, RecursionError) as exc:
        return Malformed("invalid_json", raw, fmt, str(exc) or type(exc).__name__)
    if end != len(stripped):
        return Malformed("trailing_data", raw, fmt, f"text after the JSON object: {stripped[end:][:40]!r}")
    if not isinstance(obj, dict):
        return Malformed("not_an_object", raw, fmt, f"JSON {type(obj).__name__}, not an object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return Malformed("missing_name", raw, fmt, "no function name")
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", MISSING)
    arguments, err = _normalise_arguments(args)
    if arguments is None:
        return Malformed("invalid_arguments", raw, fmt, err)
    return ToolCall(name, arguments, raw, fmt)


def _xml_value(value: str) -> Any:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    try:
        return _decode_json_value(value)
    except (ValueError, RecursionError):
        return value


def _parse_xml_function(fn_text: str, raw: str) -> ToolCall | Malformed:
    """``fn_text`` is what follows ``<function=`` up to (not including) ``</function>``."""
    fmt = "qwen3_coder_xml"
    gt = fn_text.find(">")
    if gt == -1:
        return Malformed("invalid_xml", raw, fmt, "'<function=' without '>'")
    name = fn_text[:gt].strip()
    if not name:
        return Malformed("missing_name", raw, fmt, "empty function name")
    rest = fn_text[gt + 1 :]
    n = len(rest)
    nx = NextFinder(rest)
    args: dict[str, Any] = {}
    i = nx.find(_PARAM_OPEN, 0)
    while i < n:
        start = i + len(_PARAM_OPEN)
        nxt_close = nx.find(_PARAM_CLOSE, start)
        nxt_open = nx.find(_PARAM_OPEN, start)
        if nxt_close < nxt_open:
            chunk, i_next = rest[start:nxt_close], nx.find(_PARAM_OPEN, nxt_close)
        else:
            chunk, i_next = rest[start:nxt_open], nxt_open
        pgt = chunk.find(">")
        if pgt == -1:
            return Malformed("invalid_xml", raw, fmt, "'<parameter=' without '>'")
        pname = chunk[:pgt].strip()
        if not pname:
            return Malformed("invalid_xml", raw, fmt, "empty parameter name")
        args[pname] = _xml_value(chunk[pgt + 1 :])
        i = i_next
    return ToolCall(name, args, raw, fmt)


def _parse_xml_body(body: str, raw: str) -> list[ToolCall | Malformed]:
    """Parse every ``<function=...>...</function>`` in ``body``."""
    out: list[ToolCall | Malformed] = []
    n = len(body)
    nx = NextFinder(body)
    i = nx.find(_FN_OPEN, 0)
    while i < n:
        start = i + len(_FN_OPEN)
        close = nx.find(_FN_CLOSE, start)
        nxt = nx.find(_FN_OPEN, start)
        if close == n or nxt < close:
            piece = body[i:nxt]
            out.append(Malformed("unclosed_tag", raw or piece, "qwen3_coder_xml", "'<function=' without '</function>'"))
            i = nxt
            continue
        out.append(_parse_xml_function(body[start:close], raw or body[i : close + len(_FN_CLOSE)]))
        i = nx.find(_FN_OPEN, close + len(_FN_CLOSE))
    return out


def _parse_body(body: str, raw: str) -> list[ToolCall | Malformed]:
    """Parse one ``<tool_call>`` body. An unclosed body at the end of the text comes here too:
    a complete call whose only fault is the missing ``</tool_call>`` is accepted (module doc)."""
    if body.lstrip().startswith(_FN_OPEN):
        return _parse_xml_body(body, raw)  # at least one item: the body starts with a function
    return [_parse_json_call(body, raw)]


def _extract_from_text(text: str) -> tuple[list[ToolCall | Malformed], str]:
    """Return (items in order, content text outside tool calls)."""
    items: list[ToolCall | Malformed] = []
    content: list[str] = []
    if _TC_OPEN not in text:
        if _FN_OPEN in text:
            first = text.find(_FN_OPEN)
            content.append(text[:first])
            last_close = text.rfind(_FN_CLOSE)
            tail_start = last_close + len(_FN_CLOSE) if last_close >= first else len(text)
            items.extend(_parse_xml_body(text[first:tail_start], ""))
            content.append(text[tail_start:])
        else:
            content.append(text)
        if _TC_CLOSE in text:
            items.append(Malformed("stray_close_tag", _TC_CLOSE, "qwen3_json", "'</tool_call>' without '<tool_call>'"))
        return items, "".join(content).replace(_TC_CLOSE, "")  # a stray close tag is not content (as below)

    i = 0
    n = len(text)
    nx = NextFinder(text)
    while i < n:
        j = nx.find(_TC_OPEN, i)
        seg = text[i:j]
        if _TC_CLOSE in seg:
            items.append(Malformed("stray_close_tag", _TC_CLOSE, "qwen3_json", "'</tool_call>' without '<tool_call>'"))
            seg = seg.replace(_TC_CLOSE, "")
        content.append(seg)
        if j == n:
            break
        start = j + len(_TC_OPEN)
        close = nx.find(_TC_CLOSE, start)
        nxt = nx.find(_TC_OPEN, start)
        if close < nxt:
            body = text[start:close]
            raw = text[j : close + len(_TC_CLOSE)]
            items.extend(_parse_body(body, raw))
            i = close + len(_TC_CLOSE)
        elif nxt < n:
            raw = text[j:nxt]
            fmt = "qwen3_coder_xml" if raw[len(_TC_OPEN) :].lstrip().startswith(_FN_OPEN) else "qwen3_json"
            items.append(Malformed("unclosed_tag", raw, fmt, "'<tool_call>' without '</tool_call>'"))
            i = nxt
        else:
            body = text[start:]
            raw = text[j:]
            for item in _parse_body(body, raw):
                if isinstance(item, Malformed):
                    detail = "'<tool_call>' without '</tool_call>' (truncated?)"
                    item = Malformed("unclosed_tag", raw, item.format, f"{detail}; {item.reason}: {item.detail}")
                items.append(item)
            i = n
    return items, "".join(content)


def _openai_item(item: Any) -> ToolCall | Malformed:
    fmt = "openai"
    try:
        if hasattr(item, "model_dump") and callable(item.model_dump):
            item = item.model_dump()
        try:
            raw = json.dumps(item, ensure_ascii=False, sort_keys=True, default=str)
        except (TypeError, ValueError):
            raw = repr(item)
        if not isinstance(item, Mapping):
            return Malformed("invalid_entry", raw, fmt, f"tool call entry is a {type(item).__name__}")
        fn = item.get("function", item)
        if hasattr(fn, "model_dump") and callable(fn.model_dump):
            fn = fn.model_dump()
        if not isinstance(fn, Mapping):
            return Malformed("invalid_entry", raw, fmt, "'function' is not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            return Malformed("missing_name", raw, fmt, "no function name")
        args = fn["arguments"] if "arguments" in fn else fn.get("parameters", MISSING)
        arguments, err = _normalise_arguments(args)
        if arguments is None:
            return Malformed("invalid_arguments", raw, fmt, err)
        return ToolCall(name, arguments, raw, fmt)
    except Exception as exc:  # noqa: BLE001 - never raise on model output
        return Malformed("invalid_entry", repr(item)[:200], fmt, f"{type(exc).__name__}: {exc}")


def _openai_entries(value: Any, malformed: list[Malformed]) -> list[Any]:
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            malformed.append(Malformed("invalid_json", value[:2000], "openai", str(exc)))
            return []
    if isinstance(value, Mapping) or hasattr(value, "model_dump"):
        return [value]
    try:
        return list(value)
    except TypeError:
        return [value]


def extract_tool_calls(text: str | None = None, *, openai_tool_calls: Any = None) -> Extraction:
    """Extract tool calls from a branch's output text and/or an OpenAI ``tool_calls`` list.

    Calls found in ``openai_tool_calls`` come first, then those found in ``text``. Never raises on
    model output.
    """
    calls: list[ToolCall] = []
    malformed: list[Malformed] = []
    formats: set[str] = set()
    content = ""
    reasoning: str | None = None

    if openai_tool_calls is not None:
        for entry in _openai_entries(openai_tool_calls, malformed):
            item = _openai_item(entry)
            (calls if isinstance(item, ToolCall) else malformed).append(item)  # type: ignore[arg-type]
        formats.add("openai")

    if text:
        if not isinstance(text, str):
            text = text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray)) else str(text)
        try:
            visible, reasoning = _split_thinking(text)
            items, content = _extract_from_text(visible)
        except Exception as exc:  # noqa: BLE001 - a parser bug must not raise on model output either
            items, content = [Malformed("invalid_entry", text[:2000], "qwen3_json", f"{type(exc).__name__}: {exc}")], ""
        for item in items:
            if isinstance(item, ToolCall):
                calls.append(item)
                formats.add(item.format)
            else:
                malformed.append(item)
                formats.add(item.format)
        content = content.strip()

    if not formats:
        fmt = "none"
    elif len(formats) == 1:
        fmt = next(iter(formats))
    else:
        fmt = "mixed"
    return Extraction(calls=calls, malformed=malformed, format=fmt, content=content, reasoning=reasoning)


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _key_path(base: str, key: str) -> str:
    if _IDENT.match(key):
        return f"{base}.{key}"
    return f"{base}[{json.dumps(key, ensure_ascii=False)}]"


def _type_name(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "boolean"
    if _is_num(x):
        return "number"
    if isinstance(x, str):
        return "string"
    if isinstance(x, Mapping):
        return "object"
    if isinstance(x, (list, tuple)):
        return "array"
    return type(x).__name__


def _values_equal_scalar(a: Any, b: Any) -> bool:
    if _is_num(a) and _is_num(b):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return a == b
    if type(a) is bool or type(b) is bool:
        return type(a) is type(b) and a == b
    return _type_name(a) == _type_name(b) and a == b


def _diff_values(ref: Any, cand: Any, path: str, out: list[Difference], ci: int | None, cj: int | None) -> None:
    tr, tc = _type_name(ref), _type_name(cand)
    if tr != tc:
        out.append(Difference("value_mismatch", path, ci, cj, ref, cand, f"type {tr} vs {tc}"))
        return
    if tr == "object":
        for k in ref:
            p = _key_path(path, str(k))
            if k not in cand:
                out.append(Difference("value_mismatch", p, ci, cj, ref[k], MISSING, "key missing in candidate"))
            else:
                _diff_values(ref[k], cand[k], p, out, ci, cj)
        for k in cand:
            if k not in ref:
                out.append(Difference("value_mismatch", _key_path(path, str(k)), ci, cj, MISSING, cand[k], "key not in reference"))
        return
    if tr == "array":
        if len(ref) != len(cand):
            out.append(Difference("value_mismatch", path, ci, cj, list(ref), list(cand), f"length {len(ref)} vs {len(cand)}"))
            return
        for idx, (a, b) in enumerate(zip(ref, cand)):
            _diff_values(a, b, f"{path}[{idx}]", out, ci, cj)
        return
    if not _values_equal_scalar(ref, cand):
        out.append(Difference("value_mismatch", path, ci, cj, ref, cand))


def _diff_calls(ref: ToolCall, cand: ToolCall, base: str, ci: int, cj: int) -> list[Difference]:
    out: list[Difference] = []
    if ref.name != cand.name:
        out.append(Difference("wrong_func_name", f"{base}.name", ci, cj, ref.name, cand.name))
        return out
    abase = f"{base}.arguments"
    for k, v in ref.arguments.items():
        p = _key_path(abase, k)
        if k not in cand.arguments:
            out.append(Difference("missing_param", p, ci, cj, v, MISSING))
        else:
            _diff_values(v, cand.arguments[k], p, out, ci, cj)
    for k, v in cand.arguments.items():
        if k not in ref.arguments:
            out.append(Difference("unexpected_param", _key_path(abase, k), ci, cj, MISSING, v))
    return out


_NAME_COST = 1000
_MAX_PERMUTATIONS = 50_000


def _assign(cost: list[list[int]], n: int, m: int) -> list[tuple[int, int]]:
    """Minimum-cost matching of min(n, m) pairs. Small cases enumerate the matchings, so ties go
    to the lexicographically first; larger ones (more than `_MAX_PERMUTATIONS` matchings) are
    solved exactly by scipy's ``linear_sum_assignment`` (the Hungarian method's successor,
    Jonker-Volgenant), whose ties are deterministic but not lexicographic."""
    k = min(n, m)
    if k == 0:
        return []
    if n <= m:
        if math.perm(m, n) <= _MAX_PERMUTATIONS:
            best = min(itertools.permutations(range(m), n), key=lambda p: sum(cost[i][p[i]] for i in range(n)))
            return [(i, best[i]) for i in range(n)]
    elif math.perm(n, m) <= _MAX_PERMUTATIONS:
        best = min(itertools.permutations(range(n), m), key=lambda p: sum(cost[p[j]][j] for j in range(m)))
        return sorted((best[j], j) for j in range(m))
    return _assign_exact(cost)


def _assign_exact(cost: list[list[int]]) -> list[tuple[int, int]]:
    """Minimum-cost matching of min(n, m) pairs of any size (rectangular ``cost`` allowed).
    scipy is imported here, not with the module: the proxy imports this module, and scipy would
    double its resident memory at start (64 -> 128 MiB) for a path few turns take."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(np.asarray(cost, dtype=np.int64))
    return sorted(zip(rows.tolist(), cols.tolist()))


def _as_extraction(x: Any) -> Extraction:
    if isinstance(x, Extraction):
        return x
    if x is None:
        return Extraction()
    if isinstance(x, str):
        return extract_tool_calls(x)
    if isinstance(x, ToolCall):
        return Extraction(calls=[x], format=x.format or "openai")
    calls: list[ToolCall] = []
    malformed: list[Malformed] = []
    try:
        entries = [x] if isinstance(x, Mapping) else list(x)
    except TypeError:
        entries = [x]
    for e in entries:
        if isinstance(e, ToolCall):
            calls.append(e)
        elif isinstance(e, Malformed):
            malformed.append(e)
        else:
            item = _openai_item(e)
            (calls if isinstance(item, ToolCall) else malformed).append(item)  # type: ignore[arg-type]
    return Extraction(calls=calls, malformed=malformed, format="openai" if (calls or malformed) else "none")


def compare_tool_calls(reference: Any, candidate: Any) -> Verdict:
    """Compare the candidate's tool calls against the reference's, BFCL-AST style.

    Each side may be an :class:`Extraction`, a list of :class:`ToolCall` / OpenAI-style dicts,
    or raw output text.
    """
    ref = _as_extraction(reference)
    cand = _as_extraction(candidate)
    diffs: list[Difference] = []
    for bad in ref.malformed:
        diffs.append(Difference("malformed", "$", None, None, bad.raw, MISSING, f"reference: {bad.reason}: {bad.detail}"))
    for bad in cand.malformed:
        diffs.append(Difference("malformed", "$", None, None, MISSING, bad.raw, f"candidate: {bad.reason}: {bad.detail}"))

    rc, cc = ref.calls, cand.calls
    n, m = len(rc), len(cc)
    single = n == 1 and m == 1

    def base(i: int) -> str:
        return "$" if single else f"$[{i}]"

    table = [[_diff_calls(rc[i], cc[j], base(i), i, j) for j in range(m)] for i in range(n)]
    cost = [
        [(_NAME_COST if rc[i].name != cc[j].name else len(table[i][j])) for j in range(m)]
        for i in range(n)
    ]
    pairs = _assign(cost, n, m)

    if n != m:
        diffs.append(Difference("count_mismatch", "$", None, None, n, m, f"{n} reference call(s) vs {m} candidate call(s)"))
    for i, j in pairs:
        diffs.extend(table[i][j])
    matched_i = {i for i, _ in pairs}
    matched_j = {j for _, j in pairs}
    for i in range(n):
        if i not in matched_i:
            diffs.append(Difference("count_mismatch", f"$[{i}]", i, None, rc[i], MISSING, "reference call with no candidate"))
    for j in range(m):
        if j not in matched_j:
            diffs.append(Difference("count_mismatch", f"$[{j}]", None, j, MISSING, cc[j], "candidate call with no reference"))

    present = {d.kind for d in diffs}
    verdict = next((k for k in SEVERITY if k in present), "match")
    return Verdict(verdict=verdict, differences=diffs, pairs=pairs, n_reference=n, n_candidate=m)
