"""The viewer for the browser tests: Debian's headless Chromium's path and flags, and
`serve_viewer`, the real viewer app on a free loopback port in a thread of its own."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tensorverse.ports import free_port

CHROMIUM = os.environ.get("TENSORVERSE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@contextmanager
def serve_viewer(store_path: str | os.PathLike, *, inline_rows: int = 0) -> Iterator[str]:
    """The viewer over the store at ``store_path`` (read-only); yields its base URL (``.../``).
    ``inline_rows=0``: every top-k panel is fetched per position, as for a long turn."""
    from aiohttp import web

    from tensorverse.store import Store
    from tensorverse.viz.server import create_app

    store = Store.open(Path(store_path), readonly=True)
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_app(store, host="127.0.0.1", inline_rows=inline_rows))
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        assert started.wait(20), "the viewer did not start"
        yield f"http://127.0.0.1:{port}/"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        store.close()
