"""The ``/v1/completions`` requests of a shadow run, and how their answers are read.

Every request carries the primary's prompt *token ids* (so a chat-template difference cannot
masquerade as numeric divergence):

``forced`` (:func:`forced_body`)
    teacher forcing through the decode path: ``max_tokens = len(output)``, ``ignore_eos``, no stop,
    ``temperature 0``, and ``vllm_xargs`` asking the Tensorverse plugin to force the primary's ids
    (``tv_force``) and capture every row (``tv_capture`` = the run id).
the forced fallback (:func:`scoring_body`)
    the primary's output scored as a prompt (``prompt_logprobs`` over prompt + output: the
    prefill path, top-k only), for a server that cannot force.
``free`` (:func:`free_body`)
    the shadow generates on its own from the same prompt ids: greedy, or the primary's
    temperature/top-p/top-k and seed when the primary had a seed; ``max_tokens`` as the primary
    asked (else ``len(output) + free_margin``), the primary's stop strings, capture on.

:func:`parse_completion` and :func:`parse_prompt_logprobs` read the answers.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from tensorverse.capture.optin import KEY_CAPTURE, KEY_FORCE, KEY_POSITIONS
from tensorverse.shadow.backend import Backend
from tensorverse.shadow.client import BackendError
from tensorverse.shadow.turn import TurnInput, normalize_topk

__all__ = ["forced_body", "free_sampling", "free_body", "scoring_body", "parse_completion",
           "parse_prompt_logprobs"]

_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


# --------------------------------------------------------------------------- request bodies


def _base(backend: Backend, turn: TurnInput) -> dict[str, Any]:
    body: dict[str, Any] = {}
    model = backend.model or turn.model
    if model:
        body["model"] = model
    return body


def forced_body(turn: TurnInput, backend: Backend, run_id: str, *, capture: bool = True,
                positions: str | Sequence[int] | None = None) -> dict[str, Any]:
    """The forced run's ``/v1/completions`` body (teacher forcing through the plugin)."""
    xargs: dict[str, Any] = {KEY_FORCE: list(turn.output_token_ids)}
    if capture:
        xargs[KEY_CAPTURE] = run_id
        if positions is not None:
            xargs[KEY_POSITIONS] = positions if isinstance(positions, str) else list(positions)
    body = _base(backend, turn)
    body.update({
        "prompt": list(turn.prompt_token_ids),
        "max_tokens": len(turn.output_token_ids),
        "temperature": 0,
        "ignore_eos": True,
        "n": 1,
        "stream": False,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "vllm_xargs": xargs,
    })
    _ask_logprobs(body, backend, captured=capture)
    return body


def _ask_logprobs(body: dict[str, Any], backend: Backend, *, captured: bool) -> None:
    """The API's top-k: ``backend.logprobs`` on a run without capture (its only distribution);
    ``backend.captured_logprobs`` on a run whose rows the plugin sends (its rows carry its
    distribution; behind the proxy, parsing and storing 20 entries a position cost about a tenth
    of its CPU per shadowed turn: docs/capture.md)."""
    k = backend.captured_logprobs if captured else backend.logprobs
    if k:
        body["logprobs"] = k


def free_sampling(turn: TurnInput, *, margin: int = 64) -> dict[str, Any]:
    """The free run's sampling: greedy, or the primary's sampling when it had a seed."""
    s = turn.sampling or {}
    out: dict[str, Any] = {}
    seeded = s.get("seed") is not None and (s.get("temperature") or 0) > 0
    if seeded:
        for k in ("temperature", "top_p", "top_k", "min_p", "seed"):
            if s.get(k) is not None:
                out[k] = s[k]
    else:
        out["temperature"] = 0
    mt = s.get("max_tokens")
    out["max_tokens"] = int(mt) if isinstance(mt, int) and mt > 0 else len(turn.output_token_ids) + margin
    out["max_tokens"] = max(out["max_tokens"], 1)
    for k in ("stop", "stop_token_ids"):
        if s.get(k):
            out[k] = s[k]
    for k, neutral in _PENALTIES.items():
        if s.get(k) is not None and s[k] != neutral:
            out[k] = s[k]
    return out


def free_body(turn: TurnInput, backend: Backend, run_id: str, *, capture: bool = True,
              margin: int = 64, positions: str | Sequence[int] | None = None) -> dict[str, Any]:
    """The free run's body. Capture is left out when the sampling uses penalties (they change
    the row before the plugin copies it on Model Runner V2, so the plugin refuses them)."""
    sampling = free_sampling(turn, margin=margin)
    body = _base(backend, turn)
    body.update({"prompt": list(turn.prompt_token_ids), **sampling, "n": 1, "stream": False,
                 "return_token_ids": True, "return_tokens_as_token_ids": True})
    captured = capture and not any(k in sampling for k in _PENALTIES)
    _ask_logprobs(body, backend, captured=captured)
    if captured:
        xargs: dict[str, Any] = {KEY_CAPTURE: run_id}
        if positions is not None:
            xargs[KEY_POSITIONS] = positions if isinstance(positions, str) else list(positions)
        body["vllm_xargs"] = xargs
    return body


def scoring_body(turn: TurnInput, backend: Backend) -> dict[str, Any]:
    """The forced-mode fallback: score prompt + output in one prefill (``prompt_logprobs``)."""
    body = _base(backend, turn)
    body.update({
        "prompt": [*turn.prompt_token_ids, *turn.output_token_ids],
        "max_tokens": 1,
        "temperature": 0,
        "n": 1,
        "stream": False,
        "prompt_logprobs": max(1, backend.logprobs),
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    })
    return body


# --------------------------------------------------------------------------- answers


def parse_completion(resp: Mapping[str, Any]) -> dict[str, Any]:
    """Token ids, text, finish reason and per-position top-k of a completion answer."""
    choice = resp["choices"][0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise BackendError("protocol", "the answer has no token_ids (return_token_ids not honoured: "
                           "vLLM >= 0.10 needed)", path="/completions")
    lp = choice.get("logprobs") or {}
    tops = lp.get("top_logprobs")
    top_logprobs = [normalize_topk(e) for e in tops] if isinstance(tops, list) else None
    return {
        "token_ids": [int(t) for t in ids],
        "text": choice.get("text") or "",
        "finish_reason": choice.get("finish_reason"),
        "stop_reason": choice.get("stop_reason"),
        "top_logprobs": top_logprobs,
        "token_logprobs": lp.get("token_logprobs"),
    }


def parse_prompt_logprobs(resp: Mapping[str, Any], start: int, tokens: Sequence[int]) -> dict[str, Any]:
    """Top-k and token logprobs of positions ``start..start+len(tokens)`` from ``prompt_logprobs``
    (vLLM: a list with ``None`` first, then ``{"<id>": {"logprob", "rank", ...}}`` per token)."""
    choice = resp["choices"][0]
    pl = choice.get("prompt_logprobs")
    if not isinstance(pl, list) or len(pl) < start + len(tokens):
        raise BackendError("protocol", "the answer has no prompt_logprobs for the output",
                           path="/completions")
    tops: list[list[list[float]] | None] = []
    token_lps: list[float | None] = []
    for i, t in enumerate(tokens):
        entry = pl[start + i] or {}
        d: dict[int, float] = {}
        for k, v in entry.items():
            key = k[len("token_id:"):] if isinstance(k, str) and k.startswith("token_id:") else k
            lp = v.get("logprob") if isinstance(v, Mapping) else v
            if lp is None:
                continue
            try:
                d[int(key)] = max(float(lp), -9999.0)
            except (TypeError, ValueError):
                continue
        tops.append([[tid, lp] for tid, lp in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))] or None)
        token_lps.append(d.get(int(t)))
    return {"top_logprobs": tops, "token_logprobs": token_lps}
