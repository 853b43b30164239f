"""The live sim engine's store connector (engines_adapters/sim/store_link.py) against a fake
store client: namespaced keys (salted and LoRA requests use the store, never each other's
objects), live write-back, and KV events that mark store-resident blocks with the engine's
medium for that tier, checked against the documented wire formats and fed to the hit index."""
from __future__ import annotations

import asyncio
import hashlib
from array import array

import pytest

from engines_adapters import kv_wire, sglang_wire
from engines_adapters.kv_events import apply_events
from engines_adapters.sim.model import EngineModel, SimRequest
from engines_adapters.sim.store_link import StoreLink
from engines_adapters.store.keys import KeyBook, KeyRecipe
from scheduler.hashing import block_hashes, namespace_parent, vllm_block_digests
from scheduler.hit_index import HitIndex
from tests.test_sim_model import BS, PROFILE, drain, prompt

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


class FakeStore:
    """The sim store's data path (/api/put, /api/get) as StoreClient answers it, in memory."""

    def __init__(self):
        self.objects: set[str] = set()
        self.puts: list[list[str]] = []

    async def put(self, keys, sizes):
        self.puts.append(list(keys))
        new = [k for k in keys if k not in self.objects]
        self.objects.update(keys)
        return {"stored": len(new), "existing": len(keys) - len(new), "failed": {}, "seconds": 0.0}

    async def get(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.objects:
            n += 1
        return n, 0.001 * n


def link(store: FakeStore, engine: EngineModel, recipe: str = "vllm", write: str = "through") -> StoreLink:
    sl = StoreLink("http://127.0.0.1:1", engine, MODEL, recipe, write=write)
    sl.client = store  # type: ignore[assignment]
    return sl


def engine(**kw) -> EngineModel:
    return EngineModel(PROFILE, "prefill", noise=0, kv_events=True, store_writes=True, **kw)


async def prefill(e: EngineModel, sl: StoreLink, rid: str, p: list[int], now: float = 0.0, **kw):
    """Prefetch from the store, run the request, write it (as api.py + the driver do)."""
    blocks, fetched, load_s = await sl.prefetch(p, kw.get("cache_salt"), kw.get("lora_name"))
    e.add_request(SimRequest(rid, p, 1, output_len=1, store_blocks=blocks, store_fetched=fetched,
                             store_load_s=load_s, **kw), now)
    f, results, now = drain(e, now)
    e.kv.events[:0] = [ev for r in results for ev in r.events]  # as published, then the store's own
    for r in results:
        if r.store_writes:
            sl.write(r.store_writes)
        if r.store_evicted:
            sl.evicted(r.store_evicted)
    await asyncio.gather(*sl._puts)
    return f[rid], now


def take_events(e: EngineModel) -> list:
    ev, e.kv.events = e.kv.events, []
    return ev


def test_namespaced_keys_follow_the_engines_recipes():
    p = prompt(64)
    v = KeyRecipe("vllm", MODEL, BS, seed_text="0")
    base, a, b = (v.digests(p, None, ns) for ns in (None, ("tenant-a", None), ("tenant-b", None)))
    assert a == vllm_block_digests(p, BS, seed_text="0", cache_salt="tenant-a")  # vLLM's extra keys
    assert v.digests(p, None, (None, "sql-lora")) == vllm_block_digests(p, BS, seed_text="0", lora_name="sql-lora")
    assert len({base[0], a[0], b[0], v.digests(p, None, (None, "sql-lora"))[0]}) == 4
    assert a[1:] != base[1:]  # the salt on block 0 changes every later block through the chain
    # a continued chain (parent given) does not take the salt again: the whole equals the parts
    assert v.digests(p[BS:], a[0], ("tenant-a", None)) == a[1:]
    # SGLang: the first page chains from SHA256("sglang-cache-namespace-v1" || parts), each part
    # 0x00 when absent, else 0x01 + u64 LE length + UTF-8 (extra key = the adapter, then the salt)
    s = KeyRecipe("sglang", MODEL, BS)
    seed = hashlib.sha256(b"sglang-cache-namespace-v1" + b"\x00" + b"\x01" + (8).to_bytes(8, "little")
                          + b"tenant-a").digest()
    first = hashlib.sha256(seed + array("I", p[:BS]).tobytes()).digest()
    assert s.digests(p, None, ("tenant-a", None))[0] == first
    assert s.digests(p, None, None)[0] == hashlib.sha256(array("I", p[:BS]).tobytes()).digest()
    # the memo (keyed by our namespaced index hashes) keeps tenants apart and repeats consistent
    book = KeyBook(v)
    ha = block_hashes(p, BS, parent=namespace_parent("tenant-a"))
    assert book.digests(p, ha, 2, ("tenant-a", None)) == a[:2]
    assert book.digests(p, ha, None, ("tenant-a", None)) == a
    assert book.held_prefix(p, ha, 4, set(a[:3]), ns=("tenant-a", None)) == 3


def test_salted_requests_share_the_store_within_a_tenant_only():
    async def run():
        store = FakeStore()
        e1, e2 = engine(), engine()
        l1, l2 = link(store, e1), link(store, e2)
        p = prompt(1600)
        usable = (1600 - 1) // BS * BS
        await prefill(e1, l1, "a1", p, cache_salt="tenant-a")
        assert store.objects  # salted requests now write, under their own keys
        b, _ = await prefill(e2, l2, "b", p, cache_salt="tenant-b")
        base, _ = await prefill(e2, l2, "c", p)
        assert b.store_tokens == 0 and base.store_tokens == 0  # no tenant reads another's objects
        again, _ = await prefill(e2, l2, "a2", p, cache_salt="tenant-a")
        assert again.store_tokens == usable - 0 and again.cached_tokens == usable  # the repeat hits
        lora, _ = await prefill(e2, l2, "l", p, lora_name="sql-lora")
        assert lora.store_tokens == 0
    asyncio.run(run())


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_store_resident_blocks_are_announced_in_the_engines_store_medium(flavor):
    """vLLM's MooncakeStoreConnector sends ``medium: "cpu"``; SGLang names a storage backend
    ``EXTERNAL``. The events keep the device events' block ids, parents and token ids, survive
    the documented wire encoding, and land in the hit index's store tier."""
    wire = kv_wire if flavor == "vllm" else sglang_wire
    medium = "cpu" if flavor == "vllm" else "EXTERNAL"

    async def run():
        store = FakeStore()
        e1 = engine(event_hashes=flavor)
        l1 = link(store, e1, recipe=flavor)
        p = prompt(800)
        e1.add_request(SimRequest("a", p, 1, output_len=1), 0.0)
        _, results, _ = drain(e1)
        dev = [ev for r in results for ev in r.events if isinstance(ev, kv_wire.BlockStored)]
        for r in results:
            if r.store_writes:
                l1.write(r.store_writes)
        await asyncio.gather(*l1._puts)
        stored = take_events(e1)
        assert len(stored) == 1 and stored[0].medium == medium and stored[0].parent_block_hash is None
        n = 800 // BS
        assert stored[0].block_hashes == [h for ev in dev for h in ev.block_hashes][:n]
        assert stored[0].token_ids == p[:n * BS]
        _, events, _ = wire.decode_batch(wire.encode_batch(1.0, [wire.to_sglang(ev) for ev in stored]
                                                           if flavor == "sglang" else stored, 0))
        assert events[0].medium == medium and list(events[0].block_hashes) == stored[0].block_hashes
        index = HitIndex(BS)
        index.register("prefill-1")
        assert apply_events(index, "prefill-1", dev + events) == 0
        assert index.cached_blocks("prefill-1")["store"] == n
        assert index.match(block_hashes(p, BS), n).store == n
        # a second prefill of the same prompt announces nothing new (once per residency)
        e1.add_request(SimRequest("a2", p, 1, output_len=1), 10.0)
        _, results, _ = drain(e1, 10.0)
        for r in results:
            if r.store_writes:
                l1.write(r.store_writes)
        await asyncio.gather(*l1._puts)
        assert not [ev for ev in take_events(e1) if ev.medium == medium]
        # the store drops block 30; a lookup that finds it gone announces the removal, same medium
        store.objects.discard(l1.keys.keys(p, block_hashes(p, BS))[30])
        e2 = engine(event_hashes=flavor)
        l2 = link(store, e2, recipe=flavor)
        l2.announcer.held = l1.announcer.held  # (one engine's view: it announced them)
        e2.kv.events = []
        await l2.prefetch(p)
        ev = take_events(e2)
        removed = [x for x in ev if isinstance(x, kv_wire.BlockRemoved)]
        assert len(removed) == 1 and removed[0].medium == medium
        assert removed[0].block_hashes == [stored[0].block_hashes[30]]
        loaded = [x for x in ev if isinstance(x, kv_wire.BlockStored)]
        assert not loaded  # blocks 0..29 were announced already
        assert index.block_removed("prefill-1", [kv_wire.int_hash(h) for h in removed[0].block_hashes], medium)
        assert index.match(block_hashes(p, BS), n).store == 30
    asyncio.run(run())


def test_write_back_puts_nothing_until_eviction_then_another_instance_loads_it():
    async def run():
        store = FakeStore()
        e1 = engine(kv_capacity_tokens=120 * BS, store_policy="write_back")
        l1 = link(store, e1, write="back")
        p = prompt(1600)  # 100 blocks
        a, now = await prefill(e1, l1, "a", p)
        assert store.puts == [] and not store.objects  # write-back: nothing written at prefill
        assert [ev.medium for ev in take_events(e1) if isinstance(ev, kv_wire.BlockStored)] == ["GPU"]
        b, now = await prefill(e1, l1, "b", prompt(1600, seed=2), now)  # needs the room: a's blocks go
        assert store.puts and l1.written_back >= 80 and len(store.objects) == l1.written_back
        hb = block_hashes(p, BS)
        evicted_keys = set(l1.keys.keys(p, hb))
        assert store.objects <= evicted_keys  # only a's prompt blocks, under their keys
        ev = take_events(e1)
        back = [x for x in ev if isinstance(x, kv_wire.BlockStored) and x.medium == "cpu"]
        assert len(back) == l1.written_back and all(len(x.block_hashes) == 1 for x in back)
        # the hit index follows: device removals, then the store copies chained to their parents
        index = HitIndex(BS)
        index.register("p1")
        e0 = engine(kv_capacity_tokens=120 * BS)
        e0.add_request(SimRequest("a", p, 1, output_len=1), 0.0)
        dev = [x for r in drain(e0)[1] for x in r.events]  # a's device events (same ids)
        apply_events(index, "p1", dev)
        assert apply_events(index, "p1", [x for x in ev if x.medium == "GPU"] + back) == 0
        assert index.cached_blocks("p1")["store"] == l1.written_back
        # prefill-2 loads what prefill-1 evicted (the LRU evicts a prompt's tail: prefill-2 gets
        # the head from prefill-1's store writes only where they exist, so ask the store directly)
        e2 = engine()
        l2 = link(store, e2)
        keys = l1.keys.keys(p, hb)
        first = min(i for i in range(len(hb)) if keys[i] in store.objects)
        tail = p[:]  # prefill-2 holds the head itself (it computed it), the store has the tail
        e2.add_request(SimRequest("h", p[:first * BS + 1], 1, output_len=1), 0.0)
        _, _, now2 = drain(e2)
        c, _ = await prefill(e2, l2, "c", tail, now2 + 1)
        assert c.store_tokens == ((1600 - 1) // BS - first) * BS and c.transfer_s > 0
    asyncio.run(run())


class SlowStore(FakeStore):
    """Answers a get only after ``delay`` seconds (a store falling behind)."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay

    async def get(self, keys):
        await asyncio.sleep(self.delay)
        return await super().get(keys)


def test_a_store_slower_than_the_lookup_budget_is_skipped_and_counted():
    from prometheus_client import CollectorRegistry, generate_latest

    from engines_adapters.sim.store_link import StoreFailures

    async def main():
        store = SlowStore(delay=0.0)
        e1, e2 = engine(), engine()
        p = prompt(64)
        await prefill(e1, link(store, e1), "a", p)  # written through
        fast = link(store, e2)
        fast.lookup_timeout_s = 0.5
        assert (await fast.prefetch(p))[1] > 0  # answered within the budget: loaded
        store.delay = 5.0
        slow = link(store, engine())
        slow.lookup_timeout_s = 0.05
        t0 = asyncio.get_running_loop().time()
        assert await slow.prefetch(p) == (0, 0, 0.0)  # given up on: recompute
        assert asyncio.get_running_loop().time() - t0 < 2.0  # not the store's 5 s
        assert slow.lookup_timeouts == 1 and fast.lookup_timeouts == 0
        registry = CollectorRegistry()
        registry.register(StoreFailures(slow))
        assert 'sim:store_failures_total{kind="lookup_timeout"} 1.0' in generate_latest(registry).decode()

    asyncio.run(main())
