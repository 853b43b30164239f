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

``--kv-store-write back`` is HiCache's ``write_back``: after a prefill the prompt's keys are only
remembered; a block reaches the store when the device evicts it. Salted and LoRA requests use
the store too, under keys whose digests fold the namespace in as the engine's recipe does
(engines_adapters/store/keys.py). With KV events on, blocks written to or loaded from the store
are announced in the store's medium (engines_adapters/sim/store_events.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import aiohttp
from prometheus_client.core import CounterMetricFamily

from scheduler.hashing import block_hashes, namespace_parent

from ..store.client import StoreClient, StoreUnavailable
from ..store.keys import KeyBook, KeyRecipe, Namespace
from ..store.mooncake import SCHEME as MOONCAKE, MooncakeStoreClient
from .model import EngineModel
from .store_events import StoreAnnouncer

log = logging.getLogger("conductor.sim_engine.store")
MAX_PENDING_PUTS = 64
WRITE_POLICIES = ("through", "back")


def _ns(salt: str | None, lora: str | None) -> Namespace:
    return (salt, lora) if salt or lora else None


class StoreLink:
    def __init__(self, url: str, engine: EngineModel, model_name: str, recipe: str = "vllm", write: str = "through",
                 kick=None, mooncake: MooncakeStoreClient | None = None, lookup_timeout_s: float = 0.25):
        """``write``: ``through`` (after each prefill) or ``back`` (on device eviction; the engine
        must be built with ``store_policy="write_back"``); ``kick``: wakes the engine loop so
        store events are published at once; ``mooncake``: the real store's client
        for a ``mooncake://`` URL; ``lookup_timeout_s``: how long a prefill waits for the store's
        answer before it recomputes (a slow store must not delay every prefill)."""
        if write not in WRITE_POLICIES:
            raise ValueError(f"store write policy must be one of {', '.join(WRITE_POLICIES)}, got {write!r}")
        self.url, self.engine = url, engine
        self.write_back = write == "back"
        self.keys = KeyBook(KeyRecipe(recipe, model_name, engine.block_size, algo=engine.hash_algo))
        self.announcer = StoreAnnouncer(engine, kick)
        # write-back: prompt blocks awaiting eviction, by block hash: (position, store key, tokens,
        # cache salt, LoRA adapter); bounded (a block pushed out is never written back)
        self._pending: OrderedDict[int, tuple[int, str, list[int], str | None, str | None]] = OrderedDict()
        self.pending_max = max(1 << 16, 4 * engine.kv.capacity)
        self.written_back = 0
        self.unknown_evictions = 0
        self.bytes_per_block = engine.profile.kv_bytes_per_token * engine.block_size
        self.session: aiohttp.ClientSession | None = None
        self.client: StoreClient | MooncakeStoreClient | None = None
        if url.startswith(MOONCAKE):  # the real store (its data path; no HTTP session)
            self.client = mooncake or MooncakeStoreClient(url, block_size=engine.block_size)
        self._puts: set[asyncio.Task] = set()
        self.put_errors = 0
        self.get_errors = 0
        self.lookup_timeout_s = lookup_timeout_s
        self.lookup_timeouts = 0
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

    async def prefetch(self, prompt: list[int], salt: str | None = None,
                       lora: str | None = None) -> tuple[int, int, float]:
        """(blocks the store covers from the start, blocks fetched beyond our own, modelled load
        seconds); ``salt``/``lora``: the request's namespace (its own keys)."""
        assert self.client is not None
        bs = self.engine.block_size
        limit = (len(prompt) - 1) // bs
        if limit <= 0:
            return 0, 0, 0.0
        hashes = block_hashes(prompt, bs, parent=namespace_parent(salt, lora))[:limit]
        kv = self.engine.kv
        local = kv.match_gpu(hashes, limit)
        if kv.host_capacity:
            local += kv.match_host(hashes, local, limit)
        if local >= limit:
            return 0, 0, 0.0
        keys = self.keys.keys(prompt, hashes, limit, _ns(salt, lora))[local:]
        try:
            found, seconds = await asyncio.wait_for(self.client.get(keys), self.lookup_timeout_s)
        except TimeoutError:
            self.lookup_timeouts += 1
            self._warn(f"store lookup took over {self.lookup_timeout_s * 1000:g} ms")
            return 0, 0, 0.0
        except (StoreUnavailable, KeyError, TypeError, ValueError) as e:
            self.get_errors += 1
            self._warn(f"store get failed: {e}")
            return 0, 0, 0.0
        if found < len(keys):  # the first block it lacks: if we announced it, it was evicted since
            self.announcer.removed([hashes[local + found]])
        if not found:
            return 0, 0, 0.0
        self.announcer.stored_prefix(prompt, hashes, salt, lora, local, local + found)
        return local + found, found, seconds

    def write(self, writes: list[tuple[str, list[int], list[int], str | None, str | None]]) -> None:
        """Write prompts through in the background (bounded: beyond it a write is skipped); with
        write-back, only remember their keys until the device evicts their blocks."""
        for _rid, tokens, hashes, salt, lora in writes:
            keys = self.keys.keys(tokens, hashes, None, _ns(salt, lora))
            if self.write_back:
                bs, pending = self.engine.block_size, self._pending
                for i, (h, k) in enumerate(zip(hashes, keys, strict=True)):
                    pending[h] = (i, k, tokens[i * bs:(i + 1) * bs], salt, lora)
                    pending.move_to_end(h)
                while len(pending) > self.pending_max:
                    pending.popitem(last=False)
                continue
            self._spawn(self._put(keys, lambda ok, t=tokens, h=hashes, s=salt, lo=lora:
                                  self.announcer.stored_prefix(t, h, s, lo, 0, ok)))

    def evicted(self, blocks: list[tuple]) -> None:
        """Write-back: put the evicted blocks whose keys a prefill left (parents first)."""
        got = []
        for h, vh, parent, keys, lora in blocks:
            p = self._pending.pop(h, None)
            if p is None:
                self.unknown_evictions += 1  # an output block, or remembered too long ago
                continue
            got.append((p[0], h, vh, parent, keys, lora, p))
        if not got:
            return
        got.sort(key=lambda g: g[0])
        self.written_back += len(got)
        keys = [g[6][1] for g in got]
        self._spawn(self._put(keys, lambda ok: self.announcer.stored_blocks(
            [(g[1], g[2], g[3], g[4], g[5], g[6][2]) for g in got[:ok]])))

    def _spawn(self, coro) -> None:
        if len(self._puts) >= MAX_PENDING_PUTS:
            self.skipped_puts += 1
            coro.close()
            return
        t = asyncio.get_running_loop().create_task(coro)
        self._puts.add(t)
        t.add_done_callback(self._puts.discard)

    async def _put(self, keys: list[str], done=None) -> None:
        """Put ``keys``; ``done(n)``: the first ``n`` are in the store now."""
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
        if done is not None:
            ok = next((i for i, k in enumerate(keys) if k in failed), len(keys)) if failed else len(keys)
            done(ok)


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


class StoreFailures:
    """Prometheus collector: store calls that failed or were given up on (the engine recomputed)."""

    def __init__(self, link: StoreLink):
        self.link = link

    def collect(self):
        m = CounterMetricFamily("sim:store_failures", "Store calls that failed, timed out or were skipped "
                                "(the engine recomputed or did not write)", labels=["kind"])
        ln = self.link
        for kind, n in (("get_error", ln.get_errors), ("lookup_timeout", ln.lookup_timeouts),
                        ("put_error", ln.put_errors), ("put_skipped", ln.skipped_puts)):
            m.add_metric([kind], n)
        yield m
