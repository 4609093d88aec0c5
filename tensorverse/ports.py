"""Free loopback ports for servers this process is about to start.

The OS hands out a free port on ``bind(("127.0.0.1", 0))`` but forgets it as soon as the probe
socket closes, so two servers that a process starts one after the other (a proxy and its admin
listener, several vLLM servers of a matrix) can be given the same port. Each port is therefore
handed out once per process.
"""

from __future__ import annotations

import socket
import threading

__all__ = ["free_port"]

_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now and that this process has not handed out before."""
    with _lock:
        for _ in range(200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host} that was not handed out before")
