"""The gateway's store tier: per request, how many of the prompt's blocks the shared KV store holds.

Two ways to know, as Mooncake-aware routers do (docs/store.md):

* **events** (``[store] kv_events``): subscribe to the master's KV events (RFC #1527 format) and
  keep the set of resident blocks, by the engine's block digest parsed from each event's
  ``object_key``; a lookup is then a walk over memoised digests, no I/O;
* **query** (otherwise, and what runs against the pip-built master, whose event publisher is
  compiled out): ask ``GET /batch_query_keys`` for the prompt's keys beyond what a short-lived
  cache already knows, stopping at the first miss.

Keys are the engines' own (engines_adapters/store/keys.py: vLLM's MooncakeStoreConnector or
SGLang HiCache's recipe, a salted or LoRA request's namespace folded in as the engine folds it),
computed once per distinct block thanks to a memo by our (namespaced) index hash.
A store that stops answering marks the tier stale: lookups return None (the decision goes on
without the store) until a health check succeeds, which resyncs (events: every key again).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque

import aiohttp
import zmq
import zmq.asyncio

from engines_adapters.store.client import StoreClient, StoreUnavailable
from engines_adapters.store.events import StoreEventError, decode_payload
from engines_adapters.store.keys import KeyBook, KeyRecipe, Namespace
from gateway.config import StoreConfig
from scheduler.prefix_runs import HeldPrefixes

log = logging.getLogger("conductor.store")


class StoreTier:
    def __init__(self, cfg: StoreConfig, block_size: int, model: str):
        self.cfg = cfg
        self.recipe = KeyRecipe(cfg.key_recipe, model, block_size, seed_text=cfg.hash_seed, algo=cfg.hash_algo)
        self.book = KeyBook(self.recipe, on_learn=self._learned, on_forget=self._forgot)
        self.mode = "events" if cfg.kv_events else "query"
        self.resident: set[bytes] = set()  # events mode: digests of blocks the store holds
        # digests the memo knows, and resident ones it does not ("foreign": written for prompts
        # this gateway never looked up, or dropped from the bounded memo). While there are none,
        # a block the memo lacks cannot be resident, and a lookup skips hashing it.
        self._known: set[bytes] = set()
        self._foreign: set[bytes] = set()
        # the same blocks by our index hash, for those a lookup has mapped already, kept
        # prefix-closed (a block is in only while its whole prefix is held): a prompt's mapped
        # prefix is then found by bisection, a few probes however long it is
        self._held = HeldPrefixes()
        self._idx_of: dict[bytes, int] = {}  # digest -> index hash, for the blocks mapped
        # blocks of prompts looked up and not (yet) held: when the store's events bring one in
        # (the prefill's write-through), it is mapped at once, so the next turn bisects past it
        self._pending: OrderedDict[bytes, tuple[int, int | None]] = OrderedDict()  # digest -> (hash, parent)
        self.max_pending = 1 << 20
        self._cache: dict[str, tuple[bool, float]] = {}  # query mode: key -> (held, expires)
        self.stale = True
        self.client: StoreClient | None = None
        self.session: aiohttp.ClientSession | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None
        self.lookups = 0
        self.events = 0
        self.queries = 0
        self.resyncs = 0
        self.lookup_s: deque[float] = deque(maxlen=10_000)  # added decision latency, per lookup

    async def start(self) -> bool:
        """Connect; True if the store answered (else the tier stays stale until it does)."""
        self.session = aiohttp.ClientSession()
        self.client = StoreClient(self.session, self.cfg.url, timeout_s=self.cfg.timeout_s)
        if self.mode == "events":
            self._zmq = zmq.asyncio.Context()
            self._task = asyncio.create_task(self._subscribe(), name="store-kv-events")
        return await self.check()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.session is not None:
            await self.session.close()
        if self._zmq is not None:
            self._zmq.term()

    async def check(self) -> bool:
        """Health check (the gateway's poll): a store back after an outage is resynced."""
        assert self.client is not None
        ok = await self.client.health()
        if ok and self.stale:
            try:
                await self._resync()
            except StoreUnavailable as e:
                log.warning("store %s: resync failed: %s", self.cfg.url, e)
                return False
            log.info("store %s answers: its tier is live (%s mode)", self.cfg.url, self.mode)
            self.stale = False
        elif not ok and not self.stale:
            self._drop(f"store {self.cfg.url} failed its health check")
        return ok

    def _drop(self, why: str) -> None:
        log.warning("%s: store tier dropped and marked stale; requests go on without it", why)
        self.stale = True
        self._cache.clear()

    async def _resync(self) -> None:
        self.resyncs += 1
        self._cache.clear()
        if self.mode == "events":
            assert self.client is not None
            digest_of = self.recipe.digest_of
            self.resident = {d for d in map(digest_of, await self.client.all_keys()) if d is not None}
            self._foreign = self.resident - self._known
            self._held.clear()
            self._idx_of.clear()
            self._pending.clear()

    async def _subscribe(self) -> None:
        assert self._zmq is not None and self.cfg.kv_events
        sock = self._zmq.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.cfg.kv_events)
        last_seq = 0
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if last_seq and seq != last_seq + 1 and not self.stale:
                    self._drop(f"store events: sequence gap {last_seq} -> {seq}")  # the poll resyncs
                last_seq = seq
                try:
                    events = decode_payload(frames[2])
                except StoreEventError as e:
                    log.warning("store events: bad payload ignored: %s", e)
                    continue
                self.apply(events)
        finally:
            sock.close()

    def apply(self, events: list) -> None:
        digest_of = self.recipe.digest_of
        for ev in events:
            d = digest_of(ev.key) if ev.key else None
            if d is None:
                continue
            self.events += 1
            if ev.kind == "stored":
                self.resident.add(d)
                if d not in self._known:
                    self._foreign.add(d)
                p = self._pending.pop(d, None)
                if p is not None and self._held.add_child(p[1], p[0]):
                    self._idx_of[d] = p[0]
            else:
                self.resident.discard(d)
                self._foreign.discard(d)
                h = self._idx_of.pop(d, None)
                if h is not None:
                    self._held.remove(h)  # and the mapped blocks after it: their prefix is broken

    def _learned(self, digests: list[bytes]) -> None:
        self._known.update(digests)
        if self._foreign:
            self._foreign.difference_update(digests)

    def _forgot(self, d: bytes) -> bool:
        """The memo is full: keep the digests of resident blocks (a lookup needs them), drop the rest."""
        if d in self.resident:
            return True
        self._known.discard(d)
        self._pending.pop(d, None)
        if d in self.resident:
            self._foreign.add(d)
        return False

    # --- the per-request lookup ----------------------------------------------------------------
    async def lookup(self, tokens: list[int], hashes: list[int], usable: int, ns: Namespace = None) -> int | None:
        """Leading blocks (of the first ``usable``) the store holds; None while the tier is stale.
        ``ns``: the request's (cache salt, LoRA adapter) when it has one (``hashes`` are then its
        namespaced chain)."""
        if self.stale or usable <= 0:
            return None
        t0 = time.perf_counter()
        try:
            if self.mode == "events":
                n = self.held_prefix(tokens, hashes, usable, ns)
            else:
                n = await self._query(tokens, hashes, usable, ns)
        except StoreUnavailable as e:
            self._drop(str(e))
            return None
        self.lookups += 1
        self.lookup_s.append(time.perf_counter() - t0)
        return n

    def held_prefix(self, tokens: list[int], hashes: list[int], usable: int, ns: Namespace = None) -> int:
        """Events mode, synchronous: leading memoised digests in the resident set."""
        k = self._held.known(hashes, usable)  # the blocks mapped already
        # beyond: digests (remembered, or hashed now up to the first miss)
        n = k if k == usable else self.book.held_prefix(tokens, hashes, usable, self.resident, start=k, ns=ns,
                                                         hash_unknown=bool(self._foreign))
        if n > k or len(hashes) > n:  # after this decision: map the held ones, remember the rest's digests
            asyncio.get_running_loop().call_soon(self._remember, tokens, hashes, k, n, ns)
        return n

    def _remember(self, tokens: list[int], hashes: list[int], k: int, n: int, ns: Namespace = None) -> None:
        """Map blocks k..n (held at the lookup) and remember the digests of all the prompt's
        complete blocks beyond: the engine writes them all, so their events find them known."""
        memo, resident = self.book._memo, self.resident
        for i in range(k, n):
            h = hashes[i]
            d = memo.get(h)
            if d is None or d not in resident:  # gone since the lookup (an event came): the run ends here
                n = i
                break
            self._idx_of[d] = h
        self._held.add_run(hashes, k, n)  # (nothing if a block before k left meanwhile)
        total = len(hashes)
        if n < total:
            if hashes[total - 1] not in memo:
                self.book.digests(tokens, hashes, total, ns)
            pending = self._pending
            for i in range(n, total):  # mapped as soon as the store says it holds them
                d = memo.get(hashes[i])
                if d is not None:
                    pending[d] = (hashes[i], hashes[i - 1] if i else None)
            while len(pending) > self.max_pending:
                pending.popitem(last=False)

    async def _query(self, tokens: list[int], hashes: list[int], usable: int, ns: Namespace = None) -> int:
        assert self.client is not None
        keys = self.book.keys(tokens, hashes, usable, ns)
        now = time.monotonic()
        cache = self._cache
        n = 0
        for k in keys:
            hit = cache.get(k)
            if hit is None or hit[1] < now:
                break
            if not hit[0]:
                return n
            n += 1
        if n == len(keys):
            return n
        self.queries += 1
        held = await self.client.prefix(keys[n:])
        exp = now + self.cfg.cache_ttl_s
        for k in keys[n:n + held]:
            cache[k] = (True, exp)
        if n + held < len(keys):
            cache[keys[n + held]] = (False, exp)
        if len(cache) > self.cfg.cache_max_keys:
            self._cache = {k: v for k, v in cache.items() if v[1] >= now}
        return n + held

    def view(self) -> dict:
        lat = sorted(self.lookup_s)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3 if lat else None
        return {"url": self.cfg.url, "mode": self.mode, "stale": self.stale, "key_recipe": self.cfg.key_recipe,
                "lookups": self.lookups, "queries": self.queries, "events": self.events, "resyncs": self.resyncs,
                "resident_blocks": len(self.resident) if self.mode == "events" else None,
                "lookup_ms_p99": p99, "memo_hashed_blocks": self.book.hashed}
