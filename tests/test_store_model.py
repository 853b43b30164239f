"""The store model: capacity, eviction at the watermark, leases, replicas, bandwidth sharing; key recipes."""
from __future__ import annotations

import pytest

from engines_adapters.store.keys import KeyBook, KeyRecipe, sglang_page_digests
from engines_adapters.store.model import (
    MEDIUM_DISK,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    StoreModel,
    StoreSpec,
)
from scheduler.hashing import block_hashes, vllm_block_digests

MB = 1_000_000


def spec(**kw):
    base = dict(nodes=1, dram_bytes=100 * MB, node_bytes_per_s=1e9, transfer_bytes_per_s=1e9, op_latency_s=0.0,
                lease_ttl_s=1.0)
    base.update(kw)
    return StoreSpec(**base)


def test_put_becomes_visible_when_its_transfer_ends():
    s = StoreModel(spec())
    r = s.put(["a", "b"], [10 * MB, 10 * MB], now=0.0)
    assert r.stored == ["a", "b"] and r.done_at == pytest.approx(0.02)
    assert s.exists(["a"], now=0.01) == [False]
    assert s.exists(["a", "b", "c"], now=0.03) == [True, True, False]
    assert s.put(["a"], [10 * MB], now=1.0).existing == 1


def test_too_large_put_is_refused_with_a_clear_reason_and_the_store_keeps_serving():
    s = StoreModel(spec())
    r = s.put(["big", "ok"], [200 * MB, MB], now=0.0)
    assert "larger than a store node" in r.failed["big"] and r.stored == ["ok"]
    assert s.counters["put_start_failures_total"] == 1


def test_high_watermark_evicts_the_least_recently_used_down_by_the_eviction_ratio():
    s = StoreModel(spec(high_watermark=0.9, eviction_ratio=0.2, lease_ttl_s=0.0))
    t = 0.0
    for i in range(9):  # 90 MB: at the watermark, not over
        t = s.put([f"k{i}"], [10 * MB], now=t).done_at
    assert len(s) == 9
    s.get(["k0"], now=t)  # k0 becomes the most recently used
    t = s.put(["k9"], [5 * MB], now=t + 1).done_at  # 95 MB > 90: free at least 20 MB
    assert "k0" in s and "k1" not in s and "k2" not in s and "k3" in s
    assert s.used_bytes() <= 75 * MB
    assert s.counters["evicted_key_count"] == 2


def test_full_store_evicts_for_room_but_never_a_leased_object():
    s = StoreModel(spec(dram_bytes=30 * MB, high_watermark=1.0, lease_ttl_s=100.0))
    t = s.put(["a", "b", "c"], [10 * MB] * 3, now=0.0).done_at
    assert s.exists(["a", "b"], now=t) == [True, True]  # leased for 100 s
    r = s.put(["d"], [10 * MB], now=t)
    assert r.stored == ["d"] and "c" not in s and "a" in s and "b" in s
    assert s.remove("a", now=t) == OBJECT_HAS_LEASE and s.remove("zz", now=t) == OBJECT_NOT_FOUND
    s.exists(["d"], now=r.done_at)
    full = s.put(["e"], [10 * MB], now=r.done_at)
    assert "store full" in full.failed["e"]


def test_a_put_larger_than_the_free_room_never_evicts_its_own_batch():
    # seen in the simulator: a long prompt's write-through evicted blocks of the same put, which
    # then vanished before their transfer ended (KeyError); objects in flight are not evictable
    s = StoreModel(spec(dram_bytes=30 * MB, high_watermark=1.0, lease_ttl_s=0.0))
    t = s.put(["old"], [10 * MB], now=0.0).done_at
    r = s.put([f"n{i}" for i in range(5)], [10 * MB] * 5, now=t)
    assert r.stored == ["n0", "n1", "n2"] and "old" not in s
    assert set(r.failed) == {"n3", "n4"} and all("store full" in why for why in r.failed.values())
    assert s.exists(["n0", "n1", "n2"], now=r.done_at) == [True, True, True]
    assert s.used_bytes() == 30 * MB


def test_replicas_land_on_distinct_nodes_and_ssd_takes_evicted_objects():
    s = StoreModel(spec(nodes=3, replicas=2))
    t = s.put(["a"], [10 * MB], now=0.0).done_at
    reps = s.query("a", now=t)
    assert reps is not None and len({r.node for r in reps}) == 2
    d = StoreModel(spec(dram_bytes=20 * MB, ssd_bytes=100 * MB, high_watermark=1.0, lease_ttl_s=0.0), events=True)
    t = d.put(["x", "y"], [10 * MB] * 2, now=0.0).done_at
    t = d.put(["z"], [10 * MB], now=t).done_at
    assert d.query("x", now=t)[0].medium == MEDIUM_DISK and d.ssd_used_bytes() == 10 * MB
    assert ("stored", "x", MEDIUM_DISK) in d.events
    slow = d.get(["x"], now=t)
    fast = d.get(["z"], now=t + 10)
    assert slow.done_at - t > fast.done_at - (t + 10)  # the SSD replica reads slower


def test_concurrent_transfers_share_a_nodes_bandwidth():
    one = StoreModel(spec(node_bytes_per_s=1e9, transfer_bytes_per_s=1e9))
    t = one.put(["a", "b"], [100 * MB // 4] * 2, now=0.0).done_at
    alone = one.get(["a"], now=t + 1).done_at - (t + 1)
    s = StoreModel(spec(node_bytes_per_s=1e9, transfer_bytes_per_s=1e9))
    t = s.put(["a", "b"], [100 * MB // 4] * 2, now=0.0).done_at + 1
    first = s.get(["a"], now=t).done_at - t
    second = s.get(["b"], now=t).done_at - t  # started together with the first
    assert first == pytest.approx(alone) and second == pytest.approx(2 * alone)
    # a per-transfer cap below the node's link: two concurrent transfers do not slow each other
    w = StoreModel(spec(node_bytes_per_s=2e9, transfer_bytes_per_s=1e9))
    t = w.put(["a", "b"], [25 * MB] * 2, now=0.0).done_at + 1
    assert w.get(["a"], now=t).done_at == pytest.approx(w.get(["b"], now=t).done_at)


def test_get_stops_at_the_first_miss_and_prefix_does_not_lease():
    s = StoreModel(spec(lease_ttl_s=5.0))
    t = s.put(["a", "b", "d"], [MB] * 3, now=0.0).done_at
    assert s.prefix(["a", "b", "c", "d"], now=t) == 2
    assert s.remove("a", now=t) == 0  # prefix took no lease
    g = s.get(["b", "c", "d"], now=t)
    assert g.found == 1 and g.bytes == MB


def test_key_recipes_match_the_engines_formats():
    toks = list(range(1, 33))
    v = KeyRecipe("vllm", "meta-llama/Llama-3.1-8B-Instruct", 16)
    d = vllm_block_digests(toks, 16)
    assert v.key(d[0]) == f"Llama-3.1-8B-Instruct@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{d[0].hex()}"
    assert v.digest_of(v.key(d[1])) == d[1] and v.digest_of("other@" + d[1].hex()) is None
    s = KeyRecipe("sglang", "Qwen/Qwen3-8B", 4)
    pages = sglang_page_digests(list(range(1, 9)), 4)
    # the worked example of SGLang's chain (docs/protocols.md): tokens 1..8, page size 4
    assert pages[0].hex() == "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
    assert pages[1].hex() == "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"
    assert s.object_keys(pages[0]) == [f"Qwen-Qwen3-8B_{pages[0].hex()}_0_k", f"Qwen-Qwen3-8B_{pages[0].hex()}_0_v"]
    with pytest.raises(ValueError):
        KeyRecipe("lmcache", "m", 16)


def test_keybook_memo_gives_the_same_keys_and_hashes_only_new_blocks():
    r = KeyRecipe("vllm", "m", 4)
    book = KeyBook(r)
    a = list(range(100, 124))
    b = a[:16] + [7, 7, 7, 7, 8, 8, 8, 8]
    ka = book.keys(a, block_hashes(a, 4))
    assert ka == [r.key(x) for x in vllm_block_digests(a, 4)] and book.hashed == 6
    kb = book.keys(b, block_hashes(b, 4))
    assert kb == [r.key(x) for x in vllm_block_digests(b, 4)] and book.hashed == 8  # 4 shared blocks memoised


def test_held_prefix_hashes_lazily_and_stops_at_the_first_miss():
    r = KeyRecipe("vllm", "m", 4)
    toks = list(range(500, 540))  # 10 blocks
    ds = vllm_block_digests(toks, 4)
    held = set(ds[:6])
    book = KeyBook(r)
    assert book.held_prefix(toks, block_hashes(toks, 4), 10, held) == 6 and book.hashed == 7
    assert book.held_prefix(toks, block_hashes(toks, 4), 4, held) == 4 and book.hashed == 7  # memoised
    novel = list(range(900, 940))
    assert book.held_prefix(novel, block_hashes(novel, 4), 10, held) == 0 and book.hashed == 8  # one hash
