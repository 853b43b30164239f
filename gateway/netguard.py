"""What keeps the gateway's process alive whatever its clients do.

File descriptors are the resource a client can exhaust without sending a byte, and when they run
out it is not only new connections that fail: the gateway's own connections to its engines fail
(and must not be blamed on them), and libzmq (the KV-event sockets) aborts the whole process.
So: the open-file limit is raised to its hard limit at start; client connections are capped
well below it, leaving room for each connection's engine legs and a fixed reserve for the
engines' health checks and KV-event sockets; at the cap the oldest idle connection (no request
in progress, else one still sending its body) is closed to make room, else the newcomer gets a
503; a connection must send its request head within ``header_timeout_s`` and its body within
``body_timeout_s`` (408, or a plain close when it sent nothing); and requests in progress are
bounded (503 + Retry-After).
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("conductor")

#: descriptors kept for the process itself: logs, telemetry, the listening socket, the event loop,
#: libzmq's context (its I/O thread, reaper, signalers), plus per engine its health checks,
#: KV-event SUB socket and connections, and replay DEALER
FD_RESERVE = 96
FD_RESERVE_PER_ENGINE = 16
#: per client connection: its own socket, the engine leg in progress, one pooled engine connection
FDS_PER_CONNECTION = 3


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one (what a server should run with); returns
    the (soft, hard) limits now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:  # e.g. an infinite hard limit above the kernel's nr_open
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def connection_budget(open_files: int, engines: int) -> int:
    """How many client connections fit in ``open_files`` descriptors with the engines' share kept."""
    reserve = FD_RESERVE + FD_RESERVE_PER_ENGINE * engines
    return max(8, (open_files - reserve) // FDS_PER_CONNECTION)


@dataclass
class Limits:
    max_connections: int
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 65536
    # live state shared by every connection of one server
    conns: dict[Any, None] = field(default_factory=dict)  # insertion order: oldest first
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("evicted", "refused", "header_timeouts", "body_timeouts", "headers_too_large"), 0))
    _warned_at: float = -1e9

    def count(self, what: str) -> None:
        self.stats[what] += 1
        now = time.monotonic()
        if now - self._warned_at >= 10.0:  # one line per 10 s under a storm
            self._warned_at = now
            log.warning("client connections: %d open (limit %d); so far %s", len(self.conns), self.max_connections,
                        ", ".join(f"{k} {v}" for k, v in self.stats.items() if v))


def _raw_error(status: int, phrase: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "server_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


REFUSED = _raw_error(503, "Service Unavailable", "too many connections; retry shortly", "too_many_connections",
                     "retry-after: 1\r\n")
HEAD_TIMEOUT = _raw_error(408, "Request Timeout", "the request head did not arrive in time", "request_timeout")
BODY_TIMEOUT = _raw_error(408, "Request Timeout", "the request body did not arrive in time", "request_timeout")
HEAD_TOO_LARGE = _raw_error(431, "Request Header Fields Too Large", "the request head is too large",
                            "headers_too_large")


def guarded_protocol(limits: Limits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the connection cap and the read deadlines of ``limits``."""

    class GuardedProtocol(HttpToolsProtocol):
        guard = limits

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            self._head_bytes = 0
            self._in_head = True
            g = self.guard
            if len(g.conns) >= g.max_connections and not self._make_room():
                g.count("refused")
                transport.write(REFUSED)
                transport.close()
                return
            g.conns[self] = None
            self._arm(g.header_timeout_s, self._head_timeout)

        def _make_room(self) -> bool:
            """Close the oldest connection with no request in progress (idle keep-alive, or still
            sending its head), else the oldest still sending its body (its handler sees the client
            gone): a request being answered is never cut for a newcomer."""
            conns = self.guard.conns
            victim = next((c for c in conns if c.cycle is None or c.cycle.response_complete), None)
            if victim is None:
                victim = next((c for c in conns if c.cycle.more_body and not c.cycle.response_started), None)
                if victim is None:
                    return False
                victim.cycle.disconnected = True
                victim.cycle.message_event.set()
            conns.pop(victim, None)
            self.guard.count("evicted")
            victim._disarm()
            victim.transport.abort()  # frees the descriptor now, whatever the peer does
            return True

        def connection_lost(self, exc: Exception | None) -> None:
            self.guard.conns.pop(self, None)
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, delay: float, callback) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(delay, callback)

        def _disarm(self) -> None:
            if getattr(self, "_deadline", None) is not None:
                self._deadline.cancel()  # type: ignore[union-attr]
                self._deadline = None

        def data_received(self, data: bytes) -> None:
            was_in_head = self._in_head
            if was_in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and not was_in_head:  # this chunk began the next request
                self._head_bytes += len(data)
            if self._in_head and self._head_bytes > self.guard.max_header_bytes and not self.transport.is_closing():
                self.guard.count("headers_too_large")
                self._disarm()
                self.transport.write(HEAD_TOO_LARGE)
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._in_head:  # the next request on a kept-alive connection: its head is timed anew
                self._in_head, self._head_bytes = True, 0
                self._arm(self.guard.header_timeout_s, self._head_timeout)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._arm(self.guard.body_timeout_s, self._body_timeout)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _head_timeout(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or not self._in_head:
                return
            if self._head_bytes:  # a partial head: say why; nothing sent at all: just close
                self.guard.count("header_timeouts")
                self.transport.write(HEAD_TIMEOUT)
            self.transport.close()

        def _body_timeout(self) -> None:
            self._deadline = None
            cycle = self.cycle
            if self.transport.is_closing() or cycle is None or cycle.response_started or not cycle.more_body:
                return
            self.guard.count("body_timeouts")
            # the handler reading the body sees the client gone (and finishes the request as
            # aborted); nothing it sends afterwards reaches the socket
            cycle.disconnected = True
            cycle.message_event.set()
            self.transport.write(BODY_TIMEOUT)
            self.transport.close()

    return GuardedProtocol


class RequestLimit:
    """ASGI middleware bounding the ``/v1/`` requests in progress (a stream counts until it
    ends): beyond ``limit`` a 503 with Retry-After, before any work is done."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.active, self.refused = app, limit, 0, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            self.refused += 1
            body = json.dumps({"error": {"message": f"too many requests in progress (limit {self.limit}); "
                                         "retry shortly", "type": "server_error", "param": None,
                                         "code": "too_many_requests_in_progress"}}).encode()
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class GuardCollector:
    """Prometheus view of the guard's counters (they were only logged): a client storm shows on
    ``/metrics`` as evictions, deadlines and refusals, beside the connections open now."""

    def __init__(self, limits: Limits, request_limit: RequestLimit | None = None):
        self.limits, self.request_limit = limits, request_limit

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        lim = self.limits
        yield GaugeMetricFamily("conductor_client_connections_open", "Client connections open", value=len(lim.conns))
        yield GaugeMetricFamily("conductor_client_connections_limit", "Client connection cap",
                                value=lim.max_connections)
        events = CounterMetricFamily("conductor_client_connection_events", "Connections cut or refused by the "
                                     "guard, by reason", labels=["reason"])
        for reason, n in lim.stats.items():
            events.add_metric([reason], n)
        if self.request_limit is not None:
            events.add_metric(["requests_in_progress_limit"], self.request_limit.refused)
        yield events


class StartupReport:
    """ASGI middleware that keeps a failed start-up to one line: the lifespan's exception,
    instead of the traceback uvicorn would log, is kept in ``failure`` for the caller to report."""

    def __init__(self, app):
        self.app, self.failure = app, None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def report(message) -> None:
            if message["type"] == "lifespan.startup.failed":
                text = (message.get("message") or "").strip()
                log.debug("start-up failed:\n%s", text)
                last = text.splitlines()[-1] if text else "unknown error"
                name, sep, detail = last.partition(": ")
                self.failure = f"{name.rsplit('.', 1)[-1]}: {detail}" if sep else last
                message = {"type": message["type"], "message": ""}
            await send(message)

        await self.app(scope, receive, report)
