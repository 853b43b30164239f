"""Loopback network helpers shared by whatever starts engines: the gateway's embedded cluster,
the tests and the benchmarks.

It lives in ``engines_adapters`` because that is the lowest layer whose job involves sockets
(engine HTTP ports, ZMQ KV-event endpoints); the scheduler and predictors do no I/O, and tests
and benchmarks can import it from here without reaching up into the gateway.
"""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it; the socket is closed
    before returning, so another process could take it first: bind soon, or retry)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
