"""The ``region`` of each output position (README.md's vocabulary).

``tag_regions(pieces)`` takes the decoded text of each output token, in order, and returns one
region per token: ``thinking``, ``content``, ``tool_syntax``, ``tool_name`` or ``tool_args``.

It works on characters, not tokens: the pieces are concatenated, a state machine labels every
character, and each token then takes a region from the characters it covers. So a tag split
across tokens (``<tool``, ``_call``, ``>``) or a JSON key split in two is handled, and nothing
depends on how a tokenizer happens to cut the text.

Rules (decisions, tested in ``tests/analysis/test_regions.py``):

* ``thinking``: everything from ``<think>`` to ``</think>``, **both tags included**. A
  ``</think>`` with no ``<think>`` before it (chat templates that pre-fill ``<think>`` in the
  prompt) makes everything up to and including it thinking; pass ``start_in_thinking`` to force
  either way. An unclosed ``<think>`` runs to the end. Tool-call text inside thinking is thinking.
* ``content``: everything outside thinking and tool calls (including whitespace between them and
  any trailing special-token text such as ``<|im_end|>``).
* ``tool_syntax``: the fixed grammar of a call: ``<tool_call>`` / ``</tool_call>``; in Qwen3 JSON
  the braces, quotes, colons, commas, whitespace and the fixed keys (``{"name": "``,
  ``", "arguments": {``); in Qwen3-Coder XML ``<function=``, ``<parameter=``, ``>``,
  ``</parameter>``, ``</function>``, the newlines between elements and the one leading/trailing
  newline of a value that the parser strips.
* ``tool_name``: the characters of the function name (inside the quotes / after ``<function=``).
* ``tool_args``: what depends on the call's arguments: **argument keys** (parameter names) and
  argument values. Keys count as arguments, not syntax, because a flipped key changes the call
  (an unexpected or missing parameter); the quotes, colon and comma around a top-level key or a
  string value stay ``tool_syntax``. Inside a nested value (an object or list passed as an
  argument) every character, punctuation included, is ``tool_args``. Number, boolean and null
  literals are ``tool_args``. An ``arguments`` given as a JSON string: its content is ``tool_args``.
* A token that covers characters of several regions takes the region of its **first character
  that is not** ``tool_syntax``; a token made only of syntax is ``tool_syntax``. So ``"Gig`` is
  ``tool_args`` and ``show`` in ``{"name": "show`` is ``tool_name``: a flip in such a token is
  counted where it can change the meaning. (``</think>\\n\\n`` is ``thinking``: its first char is.)
* A token that decodes to the empty string takes the region of the character before it (or the
  first character, or ``content`` for an empty output).
* A ``<tool_call>`` body whose first non-blank character is ``<`` is scanned as XML, any other
  as JSON (labels stay sensible on truncated or broken output); a bare ``<function=...>...</function>`` outside
  ``<tool_call>`` (Qwen3-Coder sometimes omits the wrapper) is a tool call.

Never raises on odd input; linear in the text length for well-formed output.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CONTENT",
    "REGIONS",
    "THINKING",
    "TOOL_ARGS",
    "TOOL_NAME",
    "TOOL_SYNTAX",
    "char_regions",
    "tag_regions",
]

THINKING = "thinking"
CONTENT = "content"
TOOL_SYNTAX = "tool_syntax"
TOOL_NAME = "tool_name"
TOOL_ARGS = "tool_args"
REGIONS: tuple[str, ...] = (THINKING, CONTENT, TOOL_SYNTAX, TOOL_NAME, TOOL_ARGS)

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_TC_OPEN = "<tool_call>"
_TC_CLOSE = "</tool_call>"
_FN_OPEN = "<function="
_FN_CLOSE = "</function>"
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"

_WS = " \t\r\n"
_ARG_KEYS = ("arguments", "parameters")


class NextFinder:
    """``str.find`` with memory, for scans whose start only moves forward.

    Searching again and again for a closing tag that never comes would make a scan quadratic;
    remembering where (or that nothing) was found keeps it linear. ``find(sub, i, end)`` returns
    the start of the first complete occurrence of ``sub`` in ``text[i:end]``, or ``end``.
    """

    __slots__ = ("text", "_memo")

    def __init__(self, text: str) -> None:
        self.text = text
        self._memo: dict[str, tuple[int, int]] = {}

    def find(self, sub: str, i: int, end: int | None = None) -> int:
        n = len(self.text)
        end = n if end is None else end
        memo = self._memo.get(sub)
        if memo is not None and memo[0] <= i and (memo[1] == -1 or memo[1] >= i):
            pos = memo[1]
        else:
            pos = self.text.find(sub, i)
            self._memo[sub] = (i, pos)
        if pos == -1 or pos + len(sub) > end:
            return end
        return pos


class _Labels:
    __slots__ = ("r", "nx")

    def __init__(self, text: str) -> None:
        self.r: list[str] = [CONTENT] * len(text)
        self.nx = NextFinder(text)

    def set(self, i: int, j: int, region: str) -> None:
        if j > i:
            self.r[i:j] = [region] * (j - i)


# ------------------------------------------------------------------------------------------
# JSON body (Qwen3 / Hermes)
# ------------------------------------------------------------------------------------------


def _skip_ws(text: str, i: int, end: int) -> int:
    while i < end and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int, end: int) -> tuple[int, int]:
    """``text[i]`` is ``"``. Return (index of the closing quote or ``end``, index after it)."""
    j = i + 1
    while j < end:
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j, j + 1
        else:
            j += 1
    return end, end


def _nested_end(text: str, i: int, end: int) -> int:
    """``text[i]`` is ``{`` or ``[``. Return the index after the matching close (or ``end``)."""
    depth = 0
    j = i
    while j < end:
        c = text[j]
        if c == '"':
            _, j = _string_end(text, j, end)
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return end


def _literal_end(text: str, i: int, end: int) -> int:
    j = i
    while j < end and text[j] not in ',}]:"{[' and text[j] not in _WS:
        j += 1
    return j


def _scan_value(text: str, i: int, end: int, lab: _Labels, inner: str) -> int:
    """Label one JSON value starting at ``i``: string quotes are syntax, the rest ``inner``."""
    if i >= end:
        return i
    c = text[i]
    if c == '"':
        close, after = _string_end(text, i, end)
        lab.set(i, i + 1, TOOL_SYNTAX)
        lab.set(i + 1, close, inner)
        lab.set(close, after, TOOL_SYNTAX)
        return after
    if c in "{[":
        j = _nested_end(text, i, end)
        lab.set(i, j, inner)
        return j
    j = _literal_end(text, i, end)
    if j == i:  # a stray delimiter where a value should be
        lab.set(i, i + 1, TOOL_SYNTAX)
        return i + 1
    lab.set(i, j, inner)
    return j


def _scan_object(text: str, i: int, end: int, lab: _Labels, top: bool) -> int:
    """``text[i]`` is ``{``. Label an object's members; return the index after ``}`` (or end).

    ``top``: the call object (``name`` / ``arguments``); otherwise the arguments object.
    """
    lab.set(i, i + 1, TOOL_SYNTAX)
    i += 1
    while i < end:
        j = _skip_ws(text, i, end)
        lab.set(i, j, TOOL_SYNTAX)
        i = j
        if i >= end:
            break
        c = text[i]
        if c == "}":
            lab.set(i, i + 1, TOOL_SYNTAX)
            return i + 1
        if c != '"':  # ',' ':' or garbage: syntax, one char at a time
            lab.set(i, i + 1, TOOL_SYNTAX)
            i += 1
            continue
        close, after = _string_end(text, i, end)
        key = text[i + 1 : close]
        lab.set(i, after, TOOL_SYNTAX)
        if not top:
            lab.set(i + 1, close, TOOL_ARGS)
        i = after
        j = _skip_ws(text, i, end)
        if j < end and text[j] == ":":
            j += 1
        j = _skip_ws(text, j, end)
        lab.set(i, j, TOOL_SYNTAX)
        i = j
        if i >= end:
            break
        if not top:
            i = _scan_value(text, i, end, lab, TOOL_ARGS)
        elif key == "name":
            i = _scan_value(text, i, end, lab, TOOL_NAME)
        elif key in _ARG_KEYS:
            if text[i] == "{":
                i = _scan_object(text, i, end, lab, top=False)
            else:
                i = _scan_value(text, i, end, lab, TOOL_ARGS)
        else:
            i = _scan_value(text, i, end, lab, TOOL_SYNTAX)
    return end


def _scan_json_body(text: str, i: int, end: int, lab: _Labels) -> None:
    j = _skip_ws(text, i, end)
    lab.set(i, j, TOOL_SYNTAX)
    i = j
    while i < end:
        if text[i] == "{":
            i = _scan_object(text, i, end, lab, top=True)
        else:
            lab.set(i, i + 1, TOOL_SYNTAX)
            i += 1


# ------------------------------------------------------------------------------------------
# XML body (Qwen3-Coder)
# ------------------------------------------------------------------------------------------


def _scan_xml_body(text: str, i: int, end: int, lab: _Labels) -> None:
    while i < end:
        if text.startswith(_FN_OPEN, i, end):
            j = i + len(_FN_OPEN)
            lab.set(i, j, TOOL_SYNTAX)
            k = j
            while k < end and text[k] not in ">\n<":
                k += 1
            lab.set(j, k, TOOL_NAME)
            if k < end and text[k] == ">":
                lab.set(k, k + 1, TOOL_SYNTAX)
                k += 1
            i = k
        elif text.startswith(_PARAM_OPEN, i, end):
            j = i + len(_PARAM_OPEN)
            lab.set(i, j, TOOL_SYNTAX)
            k = j
            while k < end and text[k] not in ">\n<":
                k += 1
            lab.set(j, k, TOOL_ARGS)
            if k < end and text[k] == ">":
                lab.set(k, k + 1, TOOL_SYNTAX)
                k += 1
            vend = min(
                lab.nx.find(_PARAM_CLOSE, k, end),
                lab.nx.find(_PARAM_OPEN, k, end),
                lab.nx.find(_FN_CLOSE, k, end),
            )
            vs, ve = k, vend
            if vs < ve and text[vs] == "\n":
                lab.set(vs, vs + 1, TOOL_SYNTAX)
                vs += 1
            if vs < ve and text[ve - 1] == "\n" and vend < end:
                lab.set(ve - 1, ve, TOOL_SYNTAX)
                ve -= 1
            lab.set(vs, ve, TOOL_ARGS)
            i = vend
            if text.startswith(_PARAM_CLOSE, i, end):
                lab.set(i, i + len(_PARAM_CLOSE), TOOL_SYNTAX)
                i += len(_PARAM_CLOSE)
        elif text.startswith(_FN_CLOSE, i, end):
            lab.set(i, i + len(_FN_CLOSE), TOOL_SYNTAX)
            i += len(_FN_CLOSE)
        else:
            lab.set(i, i + 1, TOOL_SYNTAX)
            i += 1


def _scan_tool_body(text: str, i: int, end: int, lab: _Labels) -> None:
    j = _skip_ws(text, i, end)
    if text.startswith(_FN_OPEN, j, end) or text.startswith("<", j, end):
        _scan_xml_body(text, i, end, lab)
    else:
        _scan_json_body(text, i, end, lab)


# ------------------------------------------------------------------------------------------
# Top level
# ------------------------------------------------------------------------------------------


def char_regions(text: str, *, start_in_thinking: bool | None = None) -> list[str]:
    """Region of every character of ``text`` (see the module docstring for the rules)."""
    try:
        return _char_regions(str(text) if text is not None else "", start_in_thinking)
    except Exception:  # pragma: no cover - defensive: never raise on model output  # noqa: BLE001
        return [CONTENT] * len("" if text is None else str(text))


def _char_regions(text: str, start_in_thinking: bool | None) -> list[str]:
    n = len(text)
    lab = _Labels(text)
    nx = lab.nx
    i = 0
    if start_in_thinking is None:
        close = text.find(_THINK_CLOSE)
        open_ = text.find(_THINK_OPEN)
        start_in_thinking = close != -1 and (open_ == -1 or close < open_)
    if start_in_thinking:
        close = text.find(_THINK_CLOSE)
        j = n if close == -1 else close + len(_THINK_CLOSE)
        lab.set(0, j, THINKING)
        i = j
    while i < n:
        # next interesting tag
        k = text.find("<", i)
        if k == -1:
            break  # the rest is content (already labelled)
        if text.startswith(_THINK_OPEN, k):
            close = nx.find(_THINK_CLOSE, k + len(_THINK_OPEN))
            j = min(n, close + len(_THINK_CLOSE))
            lab.set(k, j, THINKING)
            i = j
        elif text.startswith(_TC_OPEN, k):
            body = k + len(_TC_OPEN)
            lab.set(k, body, TOOL_SYNTAX)
            close = nx.find(_TC_CLOSE, body)
            nxt = nx.find(_TC_OPEN, body)
            bend = min(close, nxt)
            _scan_tool_body(text, body, bend, lab)
            i = bend
            if bend == close and close < n:
                lab.set(close, close + len(_TC_CLOSE), TOOL_SYNTAX)
                i = close + len(_TC_CLOSE)
        elif text.startswith(_TC_CLOSE, k):
            lab.set(k, k + len(_TC_CLOSE), TOOL_SYNTAX)
            i = k + len(_TC_CLOSE)
        elif text.startswith(_FN_OPEN, k):
            fclose = nx.find(_FN_CLOSE, k)
            fend = min(fclose + len(_FN_CLOSE), nx.find(_TC_OPEN, k), nx.find(_THINK_OPEN, k), n)
            _scan_xml_body(text, k, fend, lab)
            i = fend
        else:
            i = k + 1
    return lab.r


def tag_regions(pieces: Sequence[str | None], *, start_in_thinking: bool | None = None) -> list[str]:
    """Region of each output token; ``pieces`` are the tokens' decoded texts, in order.

    Returns exactly ``len(pieces)`` entries. Never raises on odd text (non-string pieces are
    converted with ``str``; ``None`` counts as empty).
    """
    texts = ["" if p is None else (p if isinstance(p, str) else str(p)) for p in pieces]
    regions = char_regions("".join(texts), start_in_thinking=start_in_thinking)
    out: list[str] = []
    pos = 0
    for t in texts:
        end = pos + len(t)
        if end == pos:
            if pos > 0:
                out.append(regions[pos - 1])
            elif regions:
                out.append(regions[0])
            else:
                out.append(CONTENT)
            continue
        chosen = TOOL_SYNTAX
        for r in regions[pos:end]:
            if r != TOOL_SYNTAX:
                chosen = r
                break
        out.append(chosen)
        pos = end
    return out


UNKNOWN = "unknown"  # the region of a position with no pieces to tag


def region_at(pieces: Sequence[str | None] | None, position: int | None) -> str:
    """The region of one output position, from the primary's decoded pieces (``unknown`` when the
    pieces or the position are missing, or the pieces cannot be tagged)."""
    if not pieces or position is None or not 0 <= position < len(pieces):
        return UNKNOWN
    try:
        return tag_regions(list(pieces))[position]
    except Exception:  # noqa: BLE001 - a label is never worth an exception
        return UNKNOWN
