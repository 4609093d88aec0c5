"""The port picker that the launcher, the demo and the test rigs share."""

from __future__ import annotations

import socket

from tensorverse.ports import free_port


def test_never_hands_out_a_port_twice_and_each_is_bindable() -> None:
    # The OS reuses a probed port as soon as the probe closes; two listeners of one process (the
    # proxy and its admin listener) once got the same one. 300 picks must all differ.
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    for port in ports[-3:]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
