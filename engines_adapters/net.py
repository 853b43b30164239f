"""Loopback network helpers shared by whatever starts engines: the gateway's embedded cluster,
the tests and the benchmarks.

It lives in ``engines_adapters`` because that is the lowest layer whose job involves sockets
(engine HTTP ports, ZMQ KV-event endpoints); the scheduler and predictors do no I/O, and tests
and benchmarks can import it from here without reaching up into the gateway.
"""
from __future__ import annotations

import random
import socket

_rng = random.SystemRandom()
#: ports this process handed out: each is free when chosen but reserved by nobody until its owner
#: binds it, so a later call in the same process (the next engine, the gateway) must not choose it
_handed_out: set[int] = set()


#: seconds an idle pooled HTTP connection is kept by our clients (loadgen's, the gateway's to its
#: engines): under the 5 s after which uvicorn (vLLM's, SGLang's and `conductor serve`'s server)
#: closes one, so a request never goes out on a connection the server is closing (the keep-alive
#: race, aio-libs/aiohttp#2682: a reset, counted as a failed request)
POOL_KEEPALIVE_S = 2.0


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the socket is closed before returning,
    so another process could take it first: bind soon, or retry).

    Chosen below the OS's ephemeral range, never from it: a client (a ZMQ PUB retrying its
    connect to a port nobody listens on yet) takes its source ports from that range and can
    connect to itself on exactly the chosen port, which then is in use when its owner binds it."""
    lo, _ = _ephemeral_range()
    if lo > 11024:
        for _ in range(64):
            port = _rng.randrange(10000, lo)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                _handed_out.add(port)
                return port
    with socket.socket() as s:  # no room below the range: let the OS pick
        s.bind((host, 0))
        return s.getsockname()[1]
