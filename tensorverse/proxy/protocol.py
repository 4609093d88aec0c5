"""Which requests are LLM turns, and the error bodies each API's clients expect, apart from
any serving logic (the stream's framing is `tensorverse.proxy.sse`; turning a response into
its recorded choices is `tensorverse.proxy.accumulate`).

The shapes are vLLM's (0.32): ``vllm/entrypoints/openai/*/protocol.py`` and
``vllm/entrypoints/anthropic/protocol.py``.
"""

from __future__ import annotations

import orjson

CHAT = "chat.completions"
COMPLETIONS = "completions"
MESSAGES = "messages"

_ENDPOINTS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/messages": MESSAGES,
}


def endpoint_kind(method: str, path: str) -> str | None:
    """The LLM endpoint a request targets (recorded as a turn), or None for a plain relay."""
    if method != "POST":
        return None
    return _ENDPOINTS.get(path.rstrip("/") if len(path) > 1 else path)


# -- errors -----------------------------------------------------------------------------------


def error_body(kind: str | None, status: int, message: str, err_type: str) -> bytes:
    """An error body the client of ``kind`` parses: OpenAI's shape, or Anthropic's."""
    if kind == MESSAGES:
        anthropic_type = {413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}.get(
            status, "api_error"
        )
        return orjson.dumps({"type": "error", "error": {"type": anthropic_type, "message": message}})
    return orjson.dumps({"error": {"message": message, "type": err_type, "param": None, "code": status}})
