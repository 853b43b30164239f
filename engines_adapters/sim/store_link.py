"""The live sim engine's store connector (``--kv-store URL``): what vLLM's MooncakeStoreConnector
or SGLang HiCache's Mooncake backend do around a prefill, against ``conductor sim-store``.

Before a request is queued: the prompt's store keys (the engine's own recipe, engines_adapters/
store/keys.py) beyond what this engine already holds are fetched with one batched get; the store
answers how many leading blocks it has and the modelled transfer time, which the engine model
charges as a KV load (``SimRequest.store_blocks``). After the step that finishes a prefill the
prompt's blocks are written through (a put of the keys the store lacks, in the background: the
request does not wait for it). A store that fails is logged and skipped: the engine recomputes.

``--kv-store mooncake://HOST:RPC_PORT`` instead puts and gets real (scaled-down) bytes through a
real Mooncake master with ``MooncakeDistributedStore`` (engines_adapters/store/mooncake.py).
"""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from prometheus_client.core import CounterMetricFamily

from scheduler.hashing import block_hashes

from ..store.client import StoreClient, StoreUnavailable
from ..store.keys import KeyBook, KeyRecipe
from ..store.mooncake import SCHEME as MOONCAKE, MooncakeStoreClient
from .model import EngineModel

log = logging.getLogger("conductor.sim_engine.store")
MAX_PENDING_PUTS = 64


class StoreLink:
    def __init__(self, url: str, engine: EngineModel, model_name: str, recipe: str = "vllm",
                 mooncake: MooncakeStoreClient | None = None):
        self.url, self.engine = url, engine
        self.keys = KeyBook(KeyRecipe(recipe, model_name, engine.block_size, algo=engine.hash_algo))
        self.bytes_per_block = engine.profile.kv_bytes_per_token * engine.block_size
        self.session: aiohttp.ClientSession | None = None
        self.client: StoreClient | MooncakeStoreClient | None = None
        if url.startswith(MOONCAKE):  # the real store (its data path; no HTTP session)
            self.client = mooncake or MooncakeStoreClient(url, block_size=engine.block_size)
        self._puts: set[asyncio.Task] = set()
        self.put_errors = 0
        self.get_errors = 0
        self.skipped_puts = 0
        self._warned = 0.0

    async def open(self) -> bool:
        if self.client is None:
            self.session = aiohttp.ClientSession()
            self.client = StoreClient(self.session, self.url)
        return await self.client.health()

    async def close(self) -> None:
        for t in list(self._puts):
            t.cancel()
        if self.session is not None:
            await self.session.close()
        elif isinstance(self.client, MooncakeStoreClient):
            await self.client.close()

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._warned > 10:
            self._warned = now
            log.warning("%s (the engine recomputes what it cannot load)", msg)

    async def prefetch(self, prompt: list[int]) -> tuple[int, int, float]:
        """(blocks the store covers from the start, blocks fetched beyond our own, modelled load seconds)."""
        assert self.client is not None
        bs = self.engine.block_size
        limit = (len(prompt) - 1) // bs
        if limit <= 0:
            return 0, 0, 0.0
        hashes = block_hashes(prompt, bs)[:limit]
        kv = self.engine.kv
        local = kv.match_gpu(hashes, limit)
        if kv.host_capacity:
            local += kv.match_host(hashes, local, limit)
        if local >= limit:
            return 0, 0, 0.0
        keys = self.keys.keys(prompt, hashes, limit)[local:]
        try:
            found, seconds = await self.client.get(keys)
        except (StoreUnavailable, KeyError, TypeError, ValueError) as e:
            self.get_errors += 1
            self._warn(f"store get failed: {e}")
            return 0, 0, 0.0
        return (local + found, found, seconds) if found else (0, 0, 0.0)

    def write(self, writes: list[tuple[str, list[int], list[int]]]) -> None:
        """Write prompts through in the background (bounded: beyond it a write is skipped)."""
        for _rid, tokens, hashes in writes:
            if len(self._puts) >= MAX_PENDING_PUTS:
                self.skipped_puts += 1
                continue
            keys = self.keys.keys(tokens, hashes)
            t = asyncio.get_running_loop().create_task(self._put(keys))
            self._puts.add(t)
            t.add_done_callback(self._puts.discard)

    async def _put(self, keys: list[str]) -> None:
        assert self.client is not None
        try:
            r = await self.client.put(keys, [self.bytes_per_block] * len(keys))
        except StoreUnavailable as e:
            self.put_errors += 1
            self._warn(f"store put failed: {e}")
            return
        failed = r.get("failed") if isinstance(r, dict) else None
        if failed:
            self.put_errors += len(failed)
            self._warn(f"store refused {len(failed)} object(s): {next(iter(failed.values()))}")


class StoreBytes:
    """Prometheus collector: real bytes moved through a Mooncake store vs the KV they stand for."""

    def __init__(self, client: MooncakeStoreClient):
        self.client = client

    def collect(self):
        c = self.client
        for name, doc, put, get in (
                ("sim:store_payload_bytes", "Bytes really moved through the Mooncake store (scaled down).",
                 c.put_payload_bytes, c.get_payload_bytes),
                ("sim:store_modelled_bytes", "Modelled KV bytes those objects stand for.",
                 c.put_modelled_bytes, c.get_modelled_bytes)):
            m = CounterMetricFamily(name, doc, labels=["op"])
            m.add_metric(["put"], put)
            m.add_metric(["get"], get)
            yield m
