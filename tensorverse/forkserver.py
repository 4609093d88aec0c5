"""The one `forkserver` context the proxy's worker processes start from.

The proxy runs its analysis (`tensorverse.shadow.analysis_workers`) and its capture ingest
(`tensorverse.proxy.ingest`) in worker processes, so that neither holds the GIL the relay needs.
Both start their workers from one fork server: a clean process, started once, that has imported
the modules the workers run already (a worker then starts in tens of milliseconds) and inherits
none of the proxy's threads or sockets. A fork server's preloaded modules are fixed when it
starts, so the list is kept here, once, for every kind of worker (it names modules, it imports
nothing: the layers of `docs/architecture.md` stay as they are).
"""

from __future__ import annotations

import multiprocessing
from typing import Any

__all__ = ["PRELOAD", "worker_context"]

#: what a worker runs: comparisons and compaction plans, and the ingest of captured frames
PRELOAD = ["tensorverse.shadow.compare", "tensorverse.store.compaction", "tensorverse.proxy.ingest"]


def worker_context() -> Any:
    """The `forkserver` multiprocessing context with `PRELOAD` (for a `ProcessPoolExecutor`)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
