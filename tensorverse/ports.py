"""Free loopback ports for servers this process is about to start.

The OS hands out a free port on ``bind(("127.0.0.1", 0))`` but forgets it as soon as the probe
socket closes, so two servers that a process starts one after the other (a proxy and its admin
listener, several vLLM servers of a matrix) can be given the same port. Each port is therefore
handed out once per process. Another process asking the OS at the same time (a second test worker)
can be given the same port too, so the ports are drawn at random below the OS's own range of
ephemeral ports (which ``bind(..., 0)`` and outgoing connections take from), and probed.
"""

from __future__ import annotations

import random
import socket
import threading

__all__ = ["free_port"]

_handed_out: set[int] = set()
_lock = threading.Lock()


_RANGE = (10_000, 32_767)  # below Linux's default ephemeral range (32768-60999)
_rng = random.SystemRandom()


def _probe(host: str, port: int) -> int | None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return None
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now and that this process has not handed out before."""
    with _lock:
        for attempt in range(400):
            port = _probe(host, _rng.randint(*_RANGE) if attempt < 200 else 0)
            if port is not None and port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host} that was not handed out before")
