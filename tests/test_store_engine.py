"""Sim engines sharing a store: a prefix computed on one prefill instance is loaded, not
recomputed, on another, with the load time charged; the simulator with ``--store``."""
from __future__ import annotations

from engines_adapters.sim.model import EngineModel, SimRequest
from engines_adapters.store.connector import ModelConnector
from engines_adapters.store.model import StoreModel, StoreSpec
from scheduler.hashing import block_hashes
from tests.test_sim_model import BS, PROFILE, drain, prompt


def engines(spec: StoreSpec, n: int = 2):
    store = StoreModel(spec)
    bpb = PROFILE.kv_bytes_per_token * BS
    conns = [ModelConnector(store, bpb) for _ in range(n)]
    return store, conns, [EngineModel(PROFILE, "prefill", noise=0, store=c) for c in conns]


def test_a_prefix_computed_on_prefill_1_is_loaded_from_the_store_on_prefill_2():
    store, (c1, c2), (e1, e2) = engines(StoreSpec())
    p = prompt(4000)
    e1.add_request(SimRequest("a", p, 1, output_len=1, hold_kv=True), 0.0)
    fa, _, now = drain(e1)
    assert len(store) == 4000 // BS  # written through after the prefill
    now += 1.0  # the put has landed
    e2.add_request(SimRequest("b", p, 1, output_len=1, hold_kv=True), now)
    fb, _, _ = drain(e2, now)
    a, b = fa["a"], fb["b"]
    usable = (4000 - 1) // BS * BS
    assert a.cached_tokens == 0 and b.cached_tokens == usable
    assert b.transfer_s > 0 and c2.loaded_blocks == usable // BS and e2.stats().store_hits == usable
    assert e2.stats().store_load_s == b.transfer_s
    assert (b.first_token - b.arrival) < 0.5 * (a.first_token - a.arrival)  # loading beats recomputing


def test_load_time_follows_the_store_bandwidth():
    times = []
    for bw in (87e9, 87e9 / 20):
        store, _, (e1, e2) = engines(StoreSpec(node_bytes_per_s=bw, transfer_bytes_per_s=bw))
        p = prompt(4000)
        e1.add_request(SimRequest("a", p, 1, output_len=1, hold_kv=True), 0.0)
        _, _, now = drain(e1)
        e2.add_request(SimRequest("b", p, 1, output_len=1, hold_kv=True), now + 1)
        fb, _, _ = drain(e2, now + 1)
        times.append(fb["b"].transfer_s)
    assert times[1] > 10 * times[0]


def test_a_store_too_small_for_an_object_refuses_it_and_the_engine_recomputes():
    store, (c1, c2), (e1, e2) = engines(StoreSpec(dram_bytes=1000))  # smaller than one block's KV
    p = prompt(600)
    e1.add_request(SimRequest("a", p, 1, output_len=1, hold_kv=True), 0.0)
    _, _, now = drain(e1)
    assert len(store) == 0 and c1.write_errors == 600 // BS and "larger than a store node" in c1.last_error
    e2.add_request(SimRequest("b", p, 1, output_len=1, hold_kv=True), now + 1)
    fb, _, _ = drain(e2, now + 1)
    assert fb["b"].cached_tokens == 0


def test_prefetched_store_answer_drives_the_live_engines_load():
    e = EngineModel(PROFILE, "prefill", noise=0, store_writes=True)
    p = prompt(800)
    e.add_request(SimRequest("a", p, 1, output_len=1, hold_kv=True, store_blocks=40, store_fetched=40,
                             store_load_s=0.25), 0.0)
    f, results, _ = drain(e)
    assert f["a"].cached_tokens == 40 * BS and abs(f["a"].transfer_s - 0.25) < 1e-9
    writes = [w for r in results for w in r.store_writes]
    assert writes and writes[0][0] == "a" and len(writes[0][2]) == 800 // BS


def test_the_simulator_with_a_store_reuses_prefixes_across_instances():
    from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec
    from loadgen.simulate.run import simulate
    from tests.test_simulate import workload

    def hit(store):
        spec = ClusterSpec(prefill=3, decode=1, store=store)
        recs = simulate(workload(60, 2.0), spec, SchedulerSpec(policy="round_robin"), progress=None).records
        return sum(r.cached_tokens or 0 for r in recs) / sum(r.prompt_tokens for r in recs)

    off, on = hit(None), hit(StoreSpec())
    assert on > off + 0.1  # round robin spreads a conversation's turns; the store shares their prefixes


def test_a_salted_prompt_is_written_with_its_namespace():
    e = EngineModel(PROFILE, "prefill", noise=0, store_writes=True)
    p = prompt(800)
    e.add_request(SimRequest("s", p, 1, output_len=1, hold_kv=True, cache_salt="tenant-a"), 0.0)
    e.add_request(SimRequest("b", p, 1, output_len=1, hold_kv=True), 0.0)
    _, results, _ = drain(e)
    w = {x[0]: x for r in results for x in r.store_writes}
    assert set(w) == {"s", "b"}
    assert w["s"][3:] == ("tenant-a", None) and w["b"][3:] == (None, None)
    assert w["s"][1] == w["b"][1] and not set(w["s"][2]) & set(w["b"][2])  # same tokens, own chain


def test_write_back_stores_blocks_when_the_device_evicts_them():
    store = StoreModel(StoreSpec())
    bpb = PROFILE.kv_bytes_per_token * BS
    e1 = EngineModel(PROFILE, "prefill", noise=0, kv_capacity_tokens=120 * BS,
                     store=ModelConnector(store, bpb), store_policy="write_back")
    p = prompt(1600)  # 100 blocks
    e1.add_request(SimRequest("a", p, 1, output_len=1, hold_kv=True), 0.0)
    _, _, now = drain(e1)
    assert len(store) == 0  # write-back: nothing yet, the blocks are still on the device
    e1.release_kv("a")
    e1.add_request(SimRequest("b", prompt(1600, seed=2), 1, output_len=1, hold_kv=True), now)
    _, _, now = drain(e1, now)  # b needs the room: a's blocks are evicted, and written back
    assert len(store) >= 80
    e1.release_kv("b")
    # a's head is still on the device (the LRU evicts a prompt's tail first), its tail in the store
    e1.add_request(SimRequest("c", p, 1, output_len=1, hold_kv=True), now + 1)
    f, _, _ = drain(e1, now + 1)
    c = f["c"]
    assert c.cached_tokens == (1600 - 1) // BS * BS and 0 < c.store_tokens < c.cached_tokens and c.transfer_s > 0


def test_live_write_back_reports_evicted_blocks_not_prefills():
    e = EngineModel(PROFILE, "prefill", noise=0, kv_capacity_tokens=120 * BS, kv_events=True,
                    store_writes=True, store_policy="write_back")
    p = prompt(1600)  # 100 blocks
    e.add_request(SimRequest("a", p, 1, output_len=1, hold_kv=True), 0.0)
    _, results, now = drain(e)
    assert [w[0] for r in results for w in r.store_writes] == ["a"]  # its keys, to remember
    assert not [x for r in results for x in r.store_evicted]
    e.release_kv("a")
    e.add_request(SimRequest("b", prompt(1600, seed=2), 1, output_len=1, hold_kv=True), now)
    _, results, _ = drain(e, now)
    ev = [x for r in results for x in r.store_evicted]
    a_hashes = set(block_hashes(p, BS))
    assert len(ev) >= 80 and {x[0] for x in ev} <= a_hashes
    assert all(isinstance(x[1], int) for x in ev)  # with the event ids the device events used
