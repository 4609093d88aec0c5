"""Tokenizers for re-tokenizing scrubbed turns, and the re-tokenization itself.

Scrubbing changes text, so the recorded token ids must change with it. Two sources of a
tokenizer, because a recording store holds ids and no tokenizer:

* :class:`HFTokenizer` — a local Hugging Face tokenizer directory (``--tokenizer DIR``: the
  model directory the primary serves, or any directory with ``tokenizer.json``), read with
  ``transformers``.
* :class:`VLLMTokenizer` — a running vLLM server of the same model (``--tokenizer-url URL``),
  through its ``/tokenize`` and ``/detokenize`` endpoints.

Both give a tokenizer fingerprint computed the same way as the shadow runner's
(:mod:`tensorverse.shadow.tokenizer`), which the corpus records and the replay runner checks
against every backend.

:func:`retokenize` keeps every token that no replacement touched: only the tokens covering a
replaced span are re-encoded (with the tokenizer that local text gets), so the rest of a prompt
stays the primary's own rendering; it then checks that the new ids decode to exactly the
scrubbed text, and re-encodes the whole text when they do not.
"""

from __future__ import annotations

import bisect
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol, Sequence

__all__ = ["Tokenizer", "HFTokenizer", "VLLMTokenizer", "retokenize", "local_fingerprint",
           "TokenizerError"]


class TokenizerError(RuntimeError):
    pass


class Tokenizer(Protocol):
    source: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str: ...

    def fingerprint(self) -> dict[str, Any]: ...


def local_fingerprint(tok: Tokenizer) -> dict[str, Any]:
    """The shadow runner's tokenizer fingerprint, computed through ``tok``."""
    from tensorverse.shadow.tokenizer import (DETOK_IDS, FINGERPRINT_VERSION, PROBE_TEXTS,
                                              SPECIAL_TOKENS, fingerprint_from_parts)

    probes = [tok.encode(t) for t in PROBE_TEXTS]
    special: dict[str, Any] = {}
    for s in SPECIAL_TOKENS:
        ids = tok.encode(s)
        special[s] = ids[0] if len(ids) == 1 else ids
    added = {"plain": tok.encode("a"), "with_special": _with_special(tok, "a")}
    try:
        detok: Any = tok.decode(list(DETOK_IDS))
    except Exception:  # noqa: BLE001 - ids beyond the vocabulary
        detok = None
    parts = {"probes": probes, "special": special, "detok": detok, "added": added}
    return {"fingerprint": fingerprint_from_parts(parts), "version": FINGERPRINT_VERSION,
            "source": tok.source}


def _with_special(tok: Any, text: str) -> list[int]:
    f = getattr(tok, "encode_with_special", None)
    return f(text) if f else tok.encode(text)


class HFTokenizer:
    """A local Hugging Face tokenizer directory."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        if not p.is_dir() or not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                   "vocab.json")):
            raise TokenizerError(f"{p}: not a tokenizer directory (no tokenizer.json)")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover
            raise TokenizerError("--tokenizer DIR needs the `transformers` package "
                                 "(or use --tokenizer-url with a vLLM server)") from e
        self._tok = AutoTokenizer.from_pretrained(str(p))
        self.source = f"hf:{p.name}"

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_with_special(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)  # a list of ids decodes to one string
        return text

    def offsets(self, ids: Sequence[int]) -> list[int] | None:
        """Character offset of each token's start in ``decode(ids)`` (plus the end), or None.

        Tokens that end inside a UTF-8 character are grouped with the next ones (their group
        starts at the first one's offset)."""
        out: list[int] = []
        pos = 0
        group: list[int] = []
        starts: list[int] = []
        for t in ids:
            group.append(t)
            starts.append(pos)
            s = self.decode(group)
            if "\ufffd" in s and len(group) < 8:
                continue
            out.extend([starts[0]] * len(group))
            pos += len(s)
            group, starts = [], []
        if group:
            out.extend([starts[0]] * len(group))
            pos += len(self.decode(group))
        out.append(pos)
        return out

    def fingerprint(self) -> dict[str, Any]:
        return local_fingerprint(self)


class VLLMTokenizer:
    """A vLLM server's ``/tokenize`` and ``/detokenize`` (blocking HTTP; for the scrubber)."""

    def __init__(self, url: str, model: str | None = None, *, timeout_s: float = 60.0,
                 api_key: str | None = None) -> None:
        u = url.rstrip("/")
        self.root = u[:-3] if u.endswith("/v1") else u
        self.model = model
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.source = f"vllm:{model or 'served'}"
        if self.model is None:
            models = self._get("/v1/models").get("data") or []
            if not models:
                raise TokenizerError(f"{self.root}: serves no model")
            self.model = models[0]["id"]
            self.source = f"vllm:{self.model}"

    def _req(self, path: str, body: dict | None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.root + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise TokenizerError(f"{self.root}{path}: {e}") from None

    def _get(self, path: str) -> dict:
        return self._req(path, None)

    def _tokenize(self, text: str, special: bool) -> list[int]:
        out = self._req("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": special})
        return [int(t) for t in out["tokens"]]

    def encode(self, text: str) -> list[int]:
        return self._tokenize(text, False)

    def encode_with_special(self, text: str) -> list[int]:
        return self._tokenize(text, True)

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        if skip_special:
            raise TokenizerError("vLLM's /detokenize cannot skip special tokens")
        return self._req("/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"]

    def offsets(self, ids: Sequence[int]) -> list[int] | None:
        return None  # one request per token would be too slow: re-encode whole texts instead

    def fingerprint(self) -> dict[str, Any]:
        return local_fingerprint(self)


def retokenize(tok: Any, ids: Sequence[int], scrub: Any) -> tuple[list[int], str, dict[str, Any]]:
    """Scrub the text of ``ids`` and return ``(new ids, scrubbed text, info)``.

    ``scrub(text) -> (new_text, spans)`` (:meth:`Scrubber.scrub_spans`). ``info``: ``changed``,
    ``method`` (``unchanged``/``local``/``full``), ``roundtrip`` (whether the original ids are
    what the tokenizer makes of their own text)."""
    ids = [int(i) for i in ids]
    text = tok.decode(ids)
    new_text, spans = scrub(text)
    if not spans:
        return ids, text, {"changed": False, "method": "unchanged"}
    info: dict[str, Any] = {"changed": True}
    new_ids: list[int] | None = None
    offs = tok.offsets(ids) if hasattr(tok, "offsets") else None
    if offs is not None and offs[-1] == len(text):
        new_ids = _local(tok, ids, text, offs, spans)
        info["method"] = "local"
        if tok.decode(new_ids) != new_text:
            new_ids = None
    if new_ids is None:
        new_ids = tok.encode(new_text)
        info["method"] = "full"
        info["roundtrip"] = tok.encode(text) == ids
        if tok.decode(new_ids) != new_text:
            raise TokenizerError("re-tokenized ids do not decode to the scrubbed text")
    return new_ids, new_text, info


def _local(tok: Any, ids: list[int], text: str, offs: list[int],
           spans: list[tuple[int, int, str]]) -> list[int]:
    """Re-encode only the token ranges that cover a replaced span."""
    n = len(ids)
    # token ranges [a, b) covering each span, merged
    ranges: list[list[int]] = []
    for s, e, _ in spans:
        a = max(0, bisect.bisect_right(offs, s, 0, n) - 1)
        b = a
        while b < n and offs[b] < e:
            b += 1
        b = max(b, a + 1)
        while b < n and offs[b] == offs[b - 1]:  # never split a grouped UTF-8 character
            b += 1
        if ranges and a <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], b)
        else:
            ranges.append([a, b])
    out: list[int] = []
    pos = 0
    for a, b in ranges:
        out.extend(ids[pos:a])
        cs, ce = offs[a], offs[b] if b < n else offs[-1]
        piece = text[cs:ce]
        for s, e, r in sorted(spans, reverse=True):  # replace right to left inside the piece
            if s >= cs and e <= ce:
                piece = piece[: s - cs] + r + piece[e - cs:]
        out.extend(tok.encode(piece))
        pos = b
    out.extend(ids[pos:])
    return out
