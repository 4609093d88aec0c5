"""Fixtures of the reliability suite (see ``harness.py``): fake backends and proxy processes that
are always torn down, and the planted secrets."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest


from tests.reliability import harness as H


@pytest.fixture
def fakes() -> Any:
    """fakes(shadows={"name": fault_or_None}) -> started `harness.Fakes` (in this process)."""
    made: list[H.Fakes] = []

    def make(shadows: dict[str, str | None] | None = None) -> H.Fakes:
        f = H.Fakes.inproc(shadows)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


@pytest.fixture
def proxy_proc(tmp_path: Path) -> Any:
    """proxy_proc(config, env=None, start=True) -> `harness.ProxyProc` (its own process)."""
    made: list[H.ProxyProc] = []

    def make(config: dict[str, Any], *, env: dict[str, str] | None = None, start: bool = True,
             workdir: Path | None = None) -> H.ProxyProc:
        p = H.ProxyProc(workdir or tmp_path / "proxy", config, env=env)
        made.append(p)
        return p.start() if start else p

    yield make
    for p in made:
        p.stop()


TOOLS = [{"type": "function", "function": {"name": "get_interface", "description": "interface state",
                                           "parameters": {"type": "object",
                                                          "properties": {"name": {"type": "string"}}}}}]


@pytest.fixture
def chat() -> Callable[..., dict[str, Any]]:
    """chat(base_url, tools=1, headers=None, **kw): one streaming chat turn with the real `openai`
    client; returns {"ok", "finish_reason", "tool_calls", "text", "error", "seconds"}."""
    import time

    from openai import OpenAI

    def run(url: str, *, tools: int = 1, headers: dict[str, str] | None = None, messages: Any = None,
            api_key: str = H.CLIENT_KEY, timeout: float = 30.0) -> dict[str, Any]:
        client = OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)
        t0 = time.perf_counter()
        out: dict[str, Any] = {"ok": False, "finish_reason": None, "tool_calls": 0, "text": "", "error": None}
        try:
            stream = client.chat.completions.create(
                model="fake", messages=messages or [{"role": "user", "content": "state of Gi0/0/1?"}],
                tools=TOOLS, stream=True, extra_headers={"X-Fake-Tools": str(tools), **(headers or {})})
            for chunk in stream:
                for ch in chunk.choices:
                    out["text"] += ch.delta.content or ""
                    out["tool_calls"] += sum(1 for tc in ch.delta.tool_calls or [] if tc.id)
                    out["finish_reason"] = ch.finish_reason or out["finish_reason"]
            out["ok"] = out["finish_reason"] is not None
        except Exception as e:  # noqa: BLE001 - the caller asserts on it
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            client.close()
        out["seconds"] = time.perf_counter() - t0
        return out

    return run
