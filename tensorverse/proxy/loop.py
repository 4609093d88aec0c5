"""The proxy's event loop: uvloop where it is installed (a dependency), asyncio's otherwise.

uvloop (libuv) runs the same aiohttp server and client with less work per socket event than
asyncio's selector loop (measured in benchmarks/RESULTS.md, Proxy). Processes that run the proxy
start their loop with `run` (or `new_event_loop` as an ``asyncio.Runner`` loop factory).
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows has none
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on the proxy's event loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
