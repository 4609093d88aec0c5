"""The proxy's event loop: uvloop where it is installed (a dependency), asyncio's otherwise.

uvloop (libuv) runs the same aiohttp server and client with less work per socket event than
asyncio's selector loop (measured in benchmarks/RESULTS.md, Proxy). Processes that run the proxy
start their loop with `run` (or `new_event_loop` as an ``asyncio.Runner`` loop factory).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Coroutine, TypeVar

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


class LoopThread:
    """An event loop running in a daemon thread: how a process whose main thread blocks (the
    demo's agent, a test) hosts the proxy or fake servers. ``loop_factory``: the proxy's loop by
    default (uvloop)."""

    def __init__(self, name: str = "tensorverse-loop",
                 loop_factory: Callable[[], asyncio.AbstractEventLoop] = new_event_loop) -> None:
        self.loop = loop_factory()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 120.0) -> T:
        """Run ``coro`` on the loop; wait for its result (at most ``timeout`` seconds)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(*args)`` on the loop's thread (for objects that must be used there)."""
        async def wrap() -> T:
            return fn(*args)

        return self.run(wrap())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.loop.is_running():
            self.loop.close()

