"""The gateway's view of its engines under faults that are not the engines' fault, or that are:
its own descriptor shortage is never blamed on an engine; a hung engine is ejected and the work
waiting on it ended; the cluster's shutdown never waits on a socket left open. In process, with
fake engines (aiohttp apps) on loopback."""
from __future__ import annotations

import asyncio
import os
import resource
import threading
from contextlib import contextmanager

import aiohttp
import pytest
import zmq
from aiohttp import web

from engines_adapters.drivers import UpstreamUnavailable
from engines_adapters.drivers.base import LocalResourceError
from engines_adapters.net import free_port
from gateway.cluster import Cluster
from gateway.config import EngineConfig, GatewayConfig


class FakeEngine:
    """/health, /metrics and /v1/models; ``hung`` makes every answer wait forever (SIGSTOP-like)."""

    def __init__(self) -> None:
        self.hung = asyncio.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if self.hung.is_set():
            await asyncio.Event().wait()
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m"}]})
        if request.path == "/metrics":
            return web.Response(text="")
        return web.Response(text="ok")

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


@contextmanager
def descriptors_exhausted():
    """Every file descriptor of this process in use (as under a flood of idle client connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    held = []
    try:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_gateways_own_descriptor_shortage_is_never_blamed_on_an_engine():
    async def main() -> None:
        engine = FakeEngine()
        runner = await engine.start()
        engines = [EngineConfig(id="e0", role="both", url=engine.url)]
        cluster = Cluster(GatewayConfig(embedded=None, engines=engines, eject_after_failures=1), engines)
        await cluster.start()
        assert cluster.healthy["e0"]
        # every call opens a new connection, as it does once the pool's are used up
        fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        client = cluster.clients["e0"]
        client.session = fresh
        try:
            with descriptors_exhausted():
                await cluster._poll("e0")
                with pytest.raises(LocalResourceError):
                    await client.open("/v1/completions", {"prompt": "x", "stream": True}, {})
            assert cluster.failures["e0"] == 0 and cluster.healthy["e0"]
            await cluster._poll("e0")  # descriptors back: an ordinary healthy probe
            assert cluster.failures["e0"] == 0 and cluster.healthy["e0"]
        finally:
            await fresh.close()
            await cluster.stop()
            await runner.cleanup()

    asyncio.run(main())


def test_a_hung_engine_is_ejected_and_the_work_waiting_on_it_ended():
    async def main() -> None:
        hung, fine = FakeEngine(), FakeEngine()
        runners = [await hung.start(), await fine.start()]
        engines = [EngineConfig(id="h", role="both", url=hung.url), EngineConfig(id="f", role="both", url=fine.url)]
        cfg = GatewayConfig(embedded=None, engines=engines, health_interval_s=0.05, health_timeout_s=0.2,
                            eject_after_failures=2)
        cluster = Cluster(cfg, engines)
        await cluster.start()
        aborted: list[str] = []
        cluster.track("h", "a stream", aborted.append)
        cluster.track("f", "another stream", aborted.append)
        first_byte = asyncio.create_task(cluster.until_ejected(asyncio.Event().wait(), ("f", "h")))
        try:
            assert cluster.healthy["h"] and cluster.healthy["f"]
            hung.hung.set()
            with pytest.raises(UpstreamUnavailable) as e:
                await asyncio.wait_for(first_byte, 10)  # ended by the ejection, not by a timeout
            assert e.value.engine == "h" and e.value.retryable
            assert not cluster.healthy["h"] and cluster.healthy["f"]
            assert aborted == ["engine h stopped answering health checks (ejected)"]  # only the hung engine's
        finally:
            hung.hung.clear()
            await cluster.stop()
            for r in runners:
                await r.cleanup()

    asyncio.run(main())


def test_shutdown_never_waits_on_a_zmq_socket_left_open():
    """A KV-event socket leaked by a failed bind or connect kept ``zmq.Context.term`` (and the
    gateway's shutdown) waiting forever."""
    engines = [EngineConfig(id="e0", role="both", url="http://127.0.0.1:9")]
    cluster = Cluster(GatewayConfig(embedded=None, engines=engines), engines)
    leaked = cluster._zmq.socket(zmq.SUB)
    t = threading.Thread(target=lambda: asyncio.run(cluster.stop()), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive()
    assert leaked.closed
