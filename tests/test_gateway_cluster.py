"""The gateway's cluster shuts down whatever its background tasks do with a cancellation."""
from __future__ import annotations

import asyncio

from gateway.cluster import Cluster
from gateway.config import EngineConfig, GatewayConfig


def test_stop_outlasts_a_lost_cancellation():
    """On Python 3.11 ``asyncio.wait_for`` drops a cancellation that arrives as its awaited answer
    does; a background loop that lost one would keep the gateway from ever finishing its shutdown
    (seen with a KV-event subscriber probing a dying engine). ``stop`` cancels until tasks end."""
    engines = [EngineConfig(id="e0", role="both", url="http://127.0.0.1:9")]
    cluster = Cluster(GatewayConfig(embedded=None, engines=engines), engines)
    lost = []

    async def loses_one_cancellation() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost.append(True)  # what wait_for's race does: carry on as if nothing happened

    async def main() -> None:
        cluster._tasks.append(asyncio.create_task(loses_one_cancellation()))
        await asyncio.sleep(0)
        await asyncio.wait_for(cluster.stop(), 10)

    asyncio.run(main())
    assert lost == [True] and cluster._tasks == []


def test_lora_adapters_are_learned_from_the_engines_model_lists():
    """vLLM lists each LoRA adapter in /v1/models with its base model as ``parent``: a request naming
    one is hashed in that adapter's namespace (gateway/proxy.py), as the engine hashes its blocks."""
    engines = [EngineConfig(id="e0", role="both", url="http://127.0.0.1:9")]
    cluster = Cluster(GatewayConfig(embedded=None, engines=engines), engines)

    async def cards(eid):
        return [{"id": "base", "parent": None, "root": "/models/base"},
                {"id": "sql-lora", "parent": "base", "root": "/adapters/sql"}]

    cluster._poll = cards
    cluster.clients = {"e0": None}  # polled by id; the stub above answers for it
    asyncio.run(cluster.poll_once())
    assert cluster.models == ["base", "sql-lora"] and cluster.adapters == {"sql-lora"}
