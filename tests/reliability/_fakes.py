"""Run the reliability suite's fake primary and shadows in their own process.

    python -m tests.reliability._fakes '{"s1": null, "s2": "hang"}'

Prints one JSON line ``{"primary": port, "<shadow>": port, ...}`` once listening; runs until
SIGTERM/SIGINT. Request logs are not kept (long runs).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from tests.reliability.harness import start_fakes


async def main() -> None:
    servers = await start_fakes(json.loads(sys.argv[1]), discard=True)
    print(json.dumps({k: v.port for k, v in servers.items()}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers.values():
        await s.close()


if __name__ == "__main__":
    asyncio.run(main())
