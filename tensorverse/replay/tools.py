"""Tool simulators: what a diverged branch of a multi-turn case gets back from its tool calls.

A replayed session continues with the *recorded* tool results while the branch's tool calls
match the recorded ones. When a branch calls something else, the recorded results no longer
answer it: the branch stops there (recorded as ``diverged`` at that turn), unless a simulator is
configured, which answers the branch's own calls so it can go on (``simulated``).

``--tool-simulator`` takes either

* ``module:function`` — a Python callable ``f(call, context) -> str | dict | list`` (sync or
  async), importable from the current directory; or
* ``http://...`` / ``https://...`` — an endpoint that gets ``POST {"call": ..., "context": ...}``
  and answers ``{"content": "..."}`` (or any JSON, used as the content).

``call`` is ``{"name", "arguments", "id"}``; ``context`` is ``{"case", "turn", "backend",
"messages"}`` (the conversation so far, scrubbed text). The answer becomes the content of a
``{"role": "tool"}`` message.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping

__all__ = ["ToolSimulator", "load_simulator", "echo_simulator"]

Simulator = Callable[[Mapping[str, Any], Mapping[str, Any]], Any]


class ToolSimulator:
    """Wraps a callable or an HTTP endpoint behind one ``await sim(call, context) -> str``."""

    def __init__(self, target: Simulator | str, *, timeout_s: float = 30.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.name = target if isinstance(target, str) else getattr(target, "__name__", "callable")

    async def __call__(self, call: Mapping[str, Any], context: Mapping[str, Any]) -> str:
        if isinstance(self.target, str):
            out = await self._http(call, context)
        else:
            out = self.target(call, context)
            if inspect.isawaitable(out):
                out = await out
        if isinstance(out, Mapping) and set(out) == {"content"}:
            out = out["content"]
        return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False)

    async def _http(self, call: Mapping[str, Any], context: Mapping[str, Any]) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        assert isinstance(self.target, str)  # __call__ sends only a URL's calls here
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.post(self.target, json={"call": call, "context": context}) as r:
                r.raise_for_status()
                return await r.json(content_type=None)


def load_simulator(spec: str | None) -> ToolSimulator | None:
    """``module:function`` or an http(s) URL (see the module docstring); None for None."""
    if not spec:
        return None
    if spec.startswith(("http://", "https://")):
        return ToolSimulator(spec)
    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn:
        raise ValueError(f"--tool-simulator {spec!r}: use module:function or an http(s) URL")
    try:
        obj = getattr(_import(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--tool-simulator {spec!r}: {e}") from None
    if not callable(obj):
        raise ValueError(f"--tool-simulator {spec!r} is not callable")
    return ToolSimulator(obj)


def _import(name: str) -> ModuleType:
    """An importable module, or else ``NAME.py`` in the working directory (``my_sim:fn`` for a
    file beside the corpus), loaded without changing ``sys.path``."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        path = Path.cwd() / (name.replace(".", "/") + ".py")
        if e.name != name.split(".")[0] or not path.is_file():
            raise
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def echo_simulator(call: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """A trivial simulator (for tests and demos): reports the call it got."""
    return json.dumps({"simulated": True, "name": call.get("name"), "arguments": call.get("arguments")})
