"""Clients cannot take the gateway's process down: read deadlines (408 or a close), the connection
cap with idle eviction, requests in progress bounded, the open-file limit raised, a failed
start-up reported in one line. A real uvicorn server with the guarded protocol on loopback."""
from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

from engines_adapters.net import free_port
from gateway.netguard import Limits, RequestLimit, StartupReport, connection_budget, guarded_protocol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class App:
    """Echoes the body's length; ``/v1/hold`` waits until released (a request in progress)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.holding = threading.Event()  # a /v1/hold request is in its handler
        self.disconnects = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.disconnects += 1
                return
            size += len(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        if scope["path"] == "/v1/hold":
            self.holding.set()
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        body = json.dumps({"size": size}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@contextmanager
def server(limits: Limits, app=None, request_limit: int | None = None):
    app = app or App()
    asgi = RequestLimit(app, request_limit) if request_limit else app
    port = free_port()
    config = uvicorn.Config(asgi, host="127.0.0.1", port=port, lifespan="off", log_level="error", loop="asyncio",
                            http=guarded_protocol(limits), timeout_keep_alive=5)  # type: ignore[arg-type]
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield port, app
    finally:
        app.release.set()
        srv.should_exit = True
        t.join(10)


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (bounded by the socket timeout)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def post(port: int, path: str = "/v1/x", body: bytes = b"{}") -> bytes:
    s = connect(port)
    s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
              .encode() + body)
    return read_all(s)


def test_a_connection_that_sends_nothing_is_closed_without_an_answer():
    with server(Limits(100, header_timeout_s=0.3)) as (port, _):
        s = connect(port)
        assert read_all(s) == b""  # closed by the server (recv would time out after 5 s otherwise)


def test_a_partial_head_gets_408_then_a_close():
    with server(Limits(100, header_timeout_s=0.3)) as (port, _):
        s = connect(port)
        s.sendall(b"POST /v1/x HTTP/1.1\r\nhost: x\r\n")
        answer = read_all(s)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_a_slow_body_gets_408_and_the_handler_sees_the_client_gone():
    with server(Limits(100, header_timeout_s=5, body_timeout_s=0.3)) as (port, app):
        s = connect(port)
        s.sendall(b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
        answer = read_all(s)
        assert answer.startswith(b"HTTP/1.1 408 ")
        for _ in range(100):
            if app.disconnects:
                break
            time.sleep(0.01)
        assert app.disconnects == 1
        assert b'"size": 2' in post(port, body=b"{}")  # the server still serves


def test_the_head_deadline_applies_to_each_request_on_a_kept_alive_connection():
    with server(Limits(100, header_timeout_s=0.5)) as (port, _):
        s = connect(port)
        s.sendall(b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        for c in b"POS":  # a slowloris on the kept-alive connection: a byte at a time, then silence
            s.sendall(bytes([c]))
            time.sleep(0.1)
        assert b"HTTP/1.1 408 " in read_all(s)


def test_an_oversized_head_gets_431():
    with server(Limits(100, max_header_bytes=2048)) as (port, _):
        s = connect(port)
        s.sendall(b"POST /v1/x HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4096 + b"\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 431 ")


def test_at_the_cap_the_oldest_idle_connection_makes_room_and_live_requests_are_never_cut():
    limits = Limits(3, header_timeout_s=30)
    with server(limits) as (port, app):
        idle = [connect(port) for _ in range(3)]
        for _ in range(100):
            if len(limits.conns) == 3:
                break
            time.sleep(0.01)
        # a newcomer is served: the oldest idle connection was closed for it
        assert b'"size": 2' in post(port)
        assert read_all(idle[0]) == b""
        assert limits.stats["evicted"] >= 1
        # three requests in progress fill the cap: nothing is idle, the newcomer is refused (503)
        held = []
        for _ in range(3):
            s = connect(port)
            s.sendall(b"POST /v1/hold HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            held.append(s)
        for _ in range(200):
            if all(c.cycle is not None and not c.cycle.response_complete for c in limits.conns):
                break
            time.sleep(0.01)
        refused = post(port)
        assert refused.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in refused.lower()
        app.release.set()
        for s in held:  # every request in progress completed
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_at_the_cap_a_request_still_sending_its_body_makes_room_when_nothing_is_idle():
    limits = Limits(2, header_timeout_s=30, body_timeout_s=30)
    with server(limits) as (port, app):
        slow = connect(port)
        slow.sendall(b"POST /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: 99\r\n\r\n{")
        held = connect(port)
        held.sendall(b"POST /v1/hold HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        for _ in range(200):
            if len(limits.conns) == 2 and all(c.cycle is not None for c in limits.conns):
                break
            time.sleep(0.01)
        assert b'"size": 2' in post(port)  # the slow upload was cut for it, not the request being answered
        assert read_all(slow) == b""
        for _ in range(100):
            if app.disconnects:
                break
            time.sleep(0.01)
        assert app.disconnects == 1  # its handler saw the client gone
        app.release.set()
        assert held.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_requests_in_progress_beyond_the_limit_get_503_with_retry_after():
    with server(Limits(100), request_limit=1) as (port, app):
        held = connect(port)
        held.sendall(b"POST /v1/hold HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        assert app.holding.wait(10)  # the first request is in progress (it waits for release)
        second = post(port)
        assert second.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in second.lower()
        assert json.loads(second.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_requests_in_progress"
        app.release.set()
        assert held.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert post(port).startswith(b"HTTP/1.1 200 ")


def test_a_failed_start_up_is_kept_to_one_line():
    async def app(scope, receive, send):
        assert scope["type"] == "lifespan"
        await receive()
        try:
            raise OSError("Address already in use (addr='tcp://127.0.0.1:5557')")
        except OSError:
            import traceback

            await send({"type": "lifespan.startup.failed", "message": traceback.format_exc()})

    report = StartupReport(app)
    sent = []

    async def receive():
        return {"type": "lifespan.startup"}

    async def send(msg):
        sent.append(msg)

    asyncio.run(report({"type": "lifespan"}, receive, send))
    assert report.failure == "OSError: Address already in use (addr='tcp://127.0.0.1:5557')"
    assert sent == [{"type": "lifespan.startup.failed", "message": ""}]  # no traceback for uvicorn to print


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 512:
        pytest.skip("needs a finite hard limit of at least 512")

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    out = subprocess.run([sys.executable, "-c", "from gateway.netguard import raise_open_file_limit as r; print(r())"],
                         cwd=ROOT, capture_output=True, text=True, preexec_fn=lower, check=True).stdout
    assert out.strip() == str((hard, hard))


def test_the_connection_budget_leaves_room_for_engine_legs_and_the_engines_sockets():
    small, large = connection_budget(1024, 6), connection_budget(20000, 6)
    assert 3 * small + 6 * 16 < 1024  # every admitted connection's descriptors fit, with the reserve
    assert large > 2500  # 2,000 idle + 500 live fit at a 20,000 limit
    assert connection_budget(50, 4) == 8  # never zero


def test_the_guards_counters_show_on_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.netguard import GuardCollector

    limits = Limits(100, max_header_bytes=2048)
    app = App()
    rl = RequestLimit(app, 1)
    registry = CollectorRegistry()
    registry.register(GuardCollector(limits, rl))
    port = free_port()
    config = uvicorn.Config(rl, host="127.0.0.1", port=port, lifespan="off", log_level="error", loop="asyncio",
                            http=guarded_protocol(limits))  # type: ignore[arg-type]
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not srv.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        big = connect(port)
        big.sendall(b"POST /v1/x HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4096 + b"\r\n")
        assert read_all(big).startswith(b"HTTP/1.1 431 ")
        held = connect(port)
        held.sendall(b"POST /v1/hold HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        while not rl.active:
            assert time.monotonic() < deadline + 10, "the held request never started"
            time.sleep(0.01)
        assert post(port).startswith(b"HTTP/1.1 503 ")
        text = generate_latest(registry).decode()
        assert 'conductor_client_connection_events_total{reason="headers_too_large"} 1.0' in text
        assert 'conductor_client_connection_events_total{reason="requests_in_progress_limit"} 1.0' in text
        assert "conductor_client_connections_open 1.0" in text  # the held one
        assert "conductor_client_connections_limit 100.0" in text
        app.release.set()
        assert held.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        app.release.set()
        srv.should_exit = True
        t.join(10)
