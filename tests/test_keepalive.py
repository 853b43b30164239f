"""Clients drop an idle pooled connection before the server at the other end closes it. A server
closes an idle keep-alive connection after its timeout; a client that picks that connection for a
new request as the close arrives gets a reset (aio-libs/aiohttp#2682), more often the busier its
event loop. Live runs counted 12-56 such failed requests per 2,400, and none once loadgen's pool was
cut under the servers' timeout (docs/experiments/live-baselines-synthetic.md)."""
from __future__ import annotations

import asyncio

import uvicorn

from engines_adapters.net import POOL_KEEPALIVE_S
from gateway.cluster import Cluster
from gateway.config import EngineConfig, GatewayConfig
from loadgen.runner import new_session

#: vLLM's OpenAI server closes idle connections after 5 s (its TIMEOUT_KEEP_ALIVE, uvicorn's
#: timeout_keep_alive); SGLang's runs uvicorn with its default, the same 5 s
ENGINE_SERVER_KEEPALIVE_S = 5.0


def test_the_servers_keepalive_is_what_the_clients_are_cut_under():
    assert uvicorn.Config(app=None).timeout_keep_alive == ENGINE_SERVER_KEEPALIVE_S  # SGLang's, and our gateway's
    assert GatewayConfig().keepalive_timeout_s == ENGINE_SERVER_KEEPALIVE_S


def test_loadgen_drops_idle_connections_before_a_gateway_or_engine_closes_them():
    async def pooled() -> float:
        s = new_session()
        try:
            return s.connector._keepalive_timeout  # type: ignore[union-attr]
        finally:
            await s.close()
    servers = min(GatewayConfig().keepalive_timeout_s, ENGINE_SERVER_KEEPALIVE_S)
    assert asyncio.run(pooled()) == POOL_KEEPALIVE_S < servers


def test_the_gateway_drops_idle_engine_connections_before_the_engine_closes_them():
    engines = [EngineConfig(id="e0", role="both", url="http://127.0.0.1:9")]
    cluster = Cluster(GatewayConfig(embedded=None, engines=engines), engines)

    async def pooled() -> float:
        try:
            await cluster._start()
            return cluster.session.connector._keepalive_timeout  # type: ignore[union-attr]
        finally:
            await cluster.stop()
    assert asyncio.run(pooled()) == POOL_KEEPALIVE_S < ENGINE_SERVER_KEEPALIVE_S
