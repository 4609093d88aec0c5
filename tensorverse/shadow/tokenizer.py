"""Same-dictionary check: tokenizer fingerprints and the chat-template check.

Shadow runs send token ids (``prompt: [ids]``) and force token ids, so a comparison only means
something when the shadow reads those ids with the primary's dictionary. A backend's tokenizer is
fingerprinted through its API (vLLM's ``/tokenize`` and ``/detokenize``, no local tokenizer):

* ``probes``: the ids of a fixed set of texts (prose, code, Unicode, a network config, a whole
  Qwen3 chat turn with ``<think>`` and ``<tool_call>``), tokenized without added special tokens;
* ``special``: the id of each well-known special/control token (``<|im_end|>``, ``<tool_call>``,
  ``<think>``...) when the tokenizer has it as one token, else the ids it splits into;
* ``detok``: the text of a fixed spread of ids decoded back (the other direction of the map);
* ``added``: what ``add_special_tokens`` prepends/appends (BOS/EOS conventions).

``fingerprint`` is a short sha256 over those parts. ``vocab_size`` (the logits width, read from
vLLM's validation message for an out-of-range ``logprob_token_ids``; no generation happens) and
``template`` (ids of a fixed chat with tools, rendered by ``/tokenize`` with ``messages``) are
reported beside it: two servers of one model with the same dictionary can still differ in chat
template, which is reported as ``template_mismatch``, never as a numeric flip (prompts are sent as
token ids, so the numbers stay comparable).

:func:`same_dictionary` says whether two fingerprints allow a comparison and, when not, why in
words; :func:`check_template` renders one recorded chat request on a backend and compares the ids
with the prompt ids the primary used.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any, Mapping, Sequence

import orjson

from tensorverse.analysis.flips import first_difference
from tensorverse.shadow.client import BackendClient, BackendError

__all__ = ["PROBE_TEXTS", "SPECIAL_TOKENS", "DETOK_IDS", "TEMPLATE_PROBE", "FINGERPRINT_VERSION",
           "fingerprint", "fingerprint_from_parts", "same_dictionary", "check_template",
           "template_difference", "vocab_size"]

FINGERPRINT_VERSION = 1

PROBE_TEXTS: tuple[str, ...] = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "interface GigabitEthernet0/0/1.201\n encapsulation dot1Q 201\n ip address 10.20.30.1 "
    "255.255.255.0\n!\nrouter bgp 65001\n neighbor 192.0.2.1 remote-as 65002",
    "def f(x: int) -> int:\n    return x ** 2  # squares\n\n\tif x != 0:\n\t\tpass",
    "café naïve 日本語のテキスト Привет мир 😀🚀 ñ ß Ω ∑ → ≠",
    "<|im_start|>system\nYou are a network assistant.<|im_end|>\n<|im_start|>user\nShow VLAN 201"
    "<|im_end|>\n<|im_start|>assistant\n<think>\nThe user wants VLAN 201.\n</think>\n\n"
    "<tool_call>\n{\"name\": \"show_vlan\", \"arguments\": {\"vlan\": 201}}\n</tool_call><|im_end|>",
    "   leading spaces,\ttabs,\n\n\nnewlines and    runs    of spaces   ",
    "0123456789 3.14159 -42 1e-10 0x1F 2026-11-30T08:00:00Z",
)

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>",
    "</think>", "<tool_response>", "</tool_response>", "<|fim_prefix|>", "<s>", "</s>",
    "<|begin_of_text|>", "<|eot_id|>",
)

# A spread over the id space; ids a smaller vocabulary lacks decode to nothing (or fail), which
# changes the fingerprint as it should.
DETOK_IDS: tuple[int, ...] = (0, 1, 2, 13, 100, 220, 271, 1000, 4096, 10000, 32000, 50000, 65535,
                              100000, 128000, 150000, 151643, 151645, 151657, 151667)

TEMPLATE_PROBE: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are a network assistant."},
        {"role": "user", "content": "Show VLAN 201 on sw1."},
    ],
    "tools": [{
        "type": "function",
        "function": {
            "name": "show_vlan",
            "description": "Show a VLAN.",
            "parameters": {"type": "object", "properties": {
                "device": {"type": "string"}, "vlan": {"type": "integer"}},
                "required": ["device", "vlan"]},
        },
    }],
    "add_generation_prompt": True,
}

_VOCAB_RE = re.compile(r"Vocabulary size:\s*(\d+)")


def _digest(obj: Any) -> str:
    return hashlib.sha256(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


async def _tokenize(client: BackendClient, text: str, add_special: bool) -> list[int]:
    return await _post_tokenize(client, {"prompt": text, "add_special_tokens": add_special})


async def _post_tokenize(client: BackendClient, body: dict) -> list[int]:
    """vLLM's `/tokenize` (text or chat messages) for the backend's model: the token ids."""
    if client.backend.model:
        body["model"] = client.backend.model
    out = await client.post("/tokenize", body, root=True)
    toks = out.get("tokens") if isinstance(out, dict) else None
    if not isinstance(toks, list):
        raise BackendError("protocol", "/tokenize answer without tokens", path="/tokenize")
    return [int(t) for t in toks]


async def vocab_size(client: BackendClient) -> int | None:
    """The model's vocabulary (logits width) from vLLM's check of ``logprob_token_ids``.

    The request asks for the logprob of an impossible token id, which vLLM refuses at admission
    with ``Vocabulary size: N``; nothing is generated. None when the server does not say."""
    body: dict[str, Any] = {"prompt": [0], "max_tokens": 1, "logprobs": 1,
                            "logprob_token_ids": [2**31 - 1]}
    if client.backend.model:
        body["model"] = client.backend.model
    try:
        await client.post("/completions", body, timeout_s=min(client.backend.timeout_s, 30))
    except BackendError as e:
        m = _VOCAB_RE.search(e.message or "")
        return int(m.group(1)) if m else None
    return None


def fingerprint_from_parts(parts: Mapping[str, Any]) -> str:
    """The fingerprint hash of the dictionary parts (``probes``, ``special``, ``detok``, ``added``)."""
    return _digest({"v": FINGERPRINT_VERSION, **{k: parts.get(k) for k in ("probes", "special",
                                                                           "detok", "added")}})


async def fingerprint(client: BackendClient, *, with_vocab: bool = True,
                      with_template: bool = True) -> dict[str, Any]:
    """Fingerprint a backend's tokenizer through its API.

    Returns ``{"available": True, "fingerprint", "special", "probes", "detok", "added",
    "vocab_size", "template", "template_fingerprint"}``, or ``{"available": False, "error"}``
    when the backend has no ``/tokenize`` (not vLLM) or cannot be reached."""
    try:
        texts = [*PROBE_TEXTS, *SPECIAL_TOKENS, "a"]
        got = await asyncio.gather(*(_tokenize(client, t, False) for t in texts),
                                   _tokenize(client, "a", True))
        probes = got[: len(PROBE_TEXTS)]
        special: dict[str, Any] = {}
        for tok, ids in zip(SPECIAL_TOKENS, got[len(PROBE_TEXTS): len(PROBE_TEXTS) + len(SPECIAL_TOKENS)]):
            special[tok] = ids[0] if len(ids) == 1 else ids
        plain, with_added = got[-2], got[-1]
        added = {"plain": plain, "with_special": with_added}
        dbody: dict[str, Any] = {"tokens": list(DETOK_IDS)}
        if client.backend.model:
            dbody["model"] = client.backend.model
        try:
            d = await client.post("/detokenize", dbody, root=True)
            detok = d.get("prompt") if isinstance(d, dict) else None
        except BackendError as e:
            if e.kind != "http":
                raise
            detok = f"error: HTTP {e.status}"
    except BackendError as e:
        return {"available": False, "error": str(e)}
    parts = {"probes": probes, "special": special, "detok": detok, "added": added}
    out: dict[str, Any] = {
        "available": True,
        "version": FINGERPRINT_VERSION,
        "fingerprint": fingerprint_from_parts(parts),
        **parts,
        "vocab_size": None,
        "template": None,
        "template_fingerprint": None,
    }
    if with_vocab:
        try:
            out["vocab_size"] = await vocab_size(client)
        except BackendError:
            pass
    if with_template:
        try:
            ids = await render_chat(client, TEMPLATE_PROBE)
            out["template"] = ids
            out["template_fingerprint"] = _digest(ids)
        except BackendError as e:
            out["template_error"] = str(e)
    return out


def same_dictionary(primary: Mapping[str, Any] | None, shadow: Mapping[str, Any] | None, *,
                    primary_name: str = "primary", shadow_name: str = "shadow",
                    strict: bool = False) -> tuple[bool, str]:
    """Whether ``shadow`` reads token ids with ``primary``'s dictionary, and why not.

    Unknown fingerprints (a backend without ``/tokenize``) are allowed with a warning unless
    ``strict``. A differing vocabulary size alone (same dictionary, other logits width) is a
    refusal too: full-vocabulary rows could not be compared."""
    if not primary or not primary.get("available") or not shadow or not shadow.get("available"):
        who = primary_name if not primary or not primary.get("available") else shadow_name
        why = ((primary or {}).get("error") if who == primary_name else (shadow or {}).get("error"))
        msg = (f"tokenizer of {who} could not be fingerprinted ({why or 'no fingerprint'}); "
               "the same-dictionary check was skipped")
        return (not strict), msg
    problems: list[str] = []
    if primary.get("fingerprint") != shadow.get("fingerprint"):
        ps, ss = primary.get("special") or {}, shadow.get("special") or {}
        diff = [tok for tok in SPECIAL_TOKENS if ps.get(tok) != ss.get(tok)]
        if diff:
            shown = ", ".join(f"{tok} is {ps.get(tok)} on {primary_name} but {ss.get(tok)} on "
                              f"{shadow_name}" for tok in diff[:3])
            more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
            problems.append(f"special tokens differ: {shown}{more}")
        pp, sp = primary.get("probes") or [], shadow.get("probes") or []
        firsts = [(i, j) for i, (a, b) in enumerate(zip(pp, sp))
                  if (j := first_difference(a, b)) is not None]
        if firsts:
            i, j = firsts[0]
            problems.append(f"{len(firsts)} of {len(PROBE_TEXTS)} probe texts tokenize differently "
                            f"(first: {PROBE_TEXTS[i][:24]!r}... from token {j} on)")
        if primary.get("detok") != shadow.get("detok"):
            problems.append("fixed token ids decode to different text")
        if primary.get("added") != shadow.get("added"):
            problems.append("add_special_tokens adds different tokens (BOS/EOS conventions)")
        if not problems:
            problems.append("fingerprints differ")
    pv, sv = primary.get("vocab_size"), shadow.get("vocab_size")
    if pv is not None and sv is not None and pv != sv:
        problems.append(f"vocabulary size {pv} on {primary_name} but {sv} on {shadow_name}")
    if problems:
        shown = "; ".join(problems)
        return False, (f"refused: {shadow_name} does not use {primary_name}'s dictionary "
                       f"(tokenizer {shadow.get('fingerprint')} vs {primary.get('fingerprint')}): "
                       f"{shown}. Token ids would mean different text, so its divergence would "
                       "not be a runtime difference.")
    return True, (f"{shadow_name} uses {primary_name}'s dictionary "
                  f"(tokenizer {shadow.get('fingerprint')})")


_CHAT_KEYS = ("messages", "tools", "chat_template_kwargs", "add_generation_prompt",
              "continue_final_message", "chat_template", "documents")


async def render_chat(client: BackendClient, request: Mapping[str, Any]) -> list[int]:
    """The prompt token ids a backend's chat template makes of a chat request (``/tokenize``)."""
    body: dict[str, Any] = {k: request[k] for k in _CHAT_KEYS if request.get(k) is not None}
    if "messages" not in body:
        raise ValueError("render_chat: the request has no messages")
    if body.get("continue_final_message"):
        body["add_generation_prompt"] = False
    body.setdefault("add_generation_prompt", True)
    body["add_special_tokens"] = False
    return await _post_tokenize(client, body)


def template_difference(expected: Sequence[int], rendered: Sequence[int]) -> dict[str, Any]:
    """``{"status": "ok"}`` or ``{"status": "template_mismatch", "first_difference", ...}``."""
    j = first_difference(list(expected), list(rendered))
    if j is None:
        return {"status": "ok", "prompt_tokens": len(expected)}
    return {
        "status": "template_mismatch",
        "first_difference": j,
        "primary_tokens": len(expected),
        "shadow_tokens": len(rendered),
        "primary_ids": list(expected[j: j + 8]),
        "shadow_ids": list(rendered[j: j + 8]),
        "message": (f"the backend's chat template renders this request to different prompt ids "
                    f"(first difference at prompt token {j}: {list(expected[j:j + 4])} on the "
                    f"primary, {list(rendered[j:j + 4])} here); prompts are sent as token ids, "
                    "so this is reported as template_mismatch, not as numeric divergence"),
    }


async def check_template(client: BackendClient, request: Mapping[str, Any] | None,
                         expected_ids: Sequence[int]) -> dict[str, Any]:
    """Render a recorded chat request on ``client``'s backend and compare with the primary's ids.

    Status ``ok``, ``template_mismatch``, ``not_chat`` (a completions request: nothing to render)
    or ``unavailable`` (the backend cannot render; ``error`` says why)."""
    if not request or not request.get("messages"):
        return {"status": "not_chat"}
    try:
        rendered = await render_chat(client, request)
    except (BackendError, ValueError) as e:
        return {"status": "unavailable", "error": str(e)}
    return template_difference(expected_ids, rendered)
