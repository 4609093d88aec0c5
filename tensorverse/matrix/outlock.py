"""One driver per results directory: an exclusive ``flock`` on ``OUT/.lock`` while a matrix or a
bisection runs there, whatever its executor.

Two drivers on one directory would both see a point as missing, both run it and race to install
its run directory; the second one refuses instead, naming the holder. The lock is the kernel's
(released when the holding process exits, even by SIGKILL), so a stale ``.lock`` file left by a
crash never blocks the next run; its content (pid, host, command) is only there for the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

__all__ = ["OutputBusy", "output_lock"]


class OutputBusy(ValueError):
    """Another driver holds ``OUT/.lock``."""


@contextlib.contextmanager
def output_lock(out: str | Path) -> Iterator[Path]:
    """Hold ``OUT/.lock`` for the block; raise :class:`OutputBusy` at once when another process
    (or another open of the same file in this one) holds it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                holder = {}
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['since']))}: "
                   f"{holder.get('command')}") if holder.get("since") else "another process"
            raise OutputBusy(f"{out} is in use by another tensorverse driver ({who}); wait for it "
                             "to finish, or use another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                  "command": " ".join(sys.argv)}).encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
