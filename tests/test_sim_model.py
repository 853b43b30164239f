"""The engine model as a pure step machine: scheduling, KV pool, PD, determinism, cost."""
from __future__ import annotations

import random

import pytest

from engines_adapters.kv_wire import BlockRemoved, BlockStored
from engines_adapters.sim.model import EngineModel, SimRequest
from engines_adapters.sim.profiles import load_profile

PROFILE = load_profile("llama3-8b-h200")
BS = 16


def prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def drain(engine: EngineModel, now: float = 0.0, max_steps: int = 100_000):
    """Step until no work and no timers; returns (finished by id, step results, end time)."""
    finished, results = {}, []
    for _ in range(max_steps):
        if not engine.has_work():
            t = engine.next_timer()
            if t is None:
                return finished, results, now
            now = max(now, t)
        r = engine.step(now)
        results.append(r)
        for f in r.finished:
            finished[f.request_id] = f
        now = r.end if not r.idle else (engine.next_timer() or now)
    raise AssertionError("engine did not drain")


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    e = EngineModel(PROFILE, max_num_batched_tokens=512, max_num_seqs=8, noise=0)
    for i in range(3):
        e.add_request(SimRequest(f"short{i}", prompt(40, i), 50, output_len=50), 0.0)
    now = 0.0
    for _ in range(3):  # get the short ones decoding
        now = e.step(now).end
    e.add_request(SimRequest("long", prompt(3000, 9), 4, output_len=4), now)
    chunks = []
    for _ in range(100):
        r = e.step(now)
        now = r.end
        assert r.prefill_tokens + r.decode_seqs <= 512
        if r.prefill_tokens:
            assert r.decode_seqs == 3  # every running decode was scheduled before the prefill chunk
            chunks.append(r.prefill_tokens)
        if any(ft.request_id == "long" for ft in r.first_tokens):
            break
    assert sum(chunks) == 3000 and len(chunks) == -(-3000 // (512 - 3))


def test_prefix_hit_on_repeated_prompt_and_faster_ttft():
    e = EngineModel(PROFILE, noise=0)
    p = prompt(2000)
    e.add_request(SimRequest("a", p, 2, output_len=2), 0.0)
    fa, _, now = drain(e)
    e.add_request(SimRequest("b", p, 2, output_len=2), now)
    fb, _, _ = drain(e, now)
    a, b = fa["a"], fb["b"]
    assert a.cached_tokens == 0
    assert b.cached_tokens == (2000 - 1) // BS * BS
    assert (b.first_token - b.arrival) < 0.25 * (a.first_token - a.arrival)
    st = e.stats()
    assert st.prefix_hits == b.cached_tokens and st.prefix_queries == 4000


def test_lru_eviction_under_small_capacity():
    e = EngineModel(PROFILE, kv_capacity_tokens=40 * BS, noise=0, kv_events=True)
    pa, pb = prompt(20 * BS, 1), prompt(30 * BS, 2)
    e.add_request(SimRequest("a", pa, 1, output_len=1), 0.0)
    _, _, now = drain(e)
    e.add_request(SimRequest("b", pb, 1, output_len=1), now)
    _, res, now = drain(e, now)
    removed = [h for r in res for ev in r.events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert len(removed) >= 10  # a's blocks made room for b
    # b is fully cached; a lost its least recently used (tail) blocks first
    e.add_request(SimRequest("b2", pb, 1, output_len=1), now)
    fb, _, now = drain(e, now)
    assert fb["b2"].cached_tokens == (30 * BS - 1) // BS * BS
    e.add_request(SimRequest("a2", pa, 1, output_len=1), now)
    fa, _, _ = drain(e, now)
    assert fa["a2"].cached_tokens < 20 * BS - BS
    assert e.kv.num_free() == e.kv.capacity  # nothing leaked


def test_preemption_when_blocks_run_out_and_exact_lengths():
    cap_blocks = 24
    e = EngineModel(PROFILE, kv_capacity_tokens=cap_blocks * BS, noise=0, max_num_seqs=8)
    for i in range(4):  # each grows to 100 + 200 tokens = 19 blocks: they cannot all fit
        e.add_request(SimRequest(f"r{i}", prompt(100, i), 200, output_len=200), 0.0)
    fin, res, _ = drain(e)
    assert e.stats().preemptions > 0
    assert any(r.preempted for r in res)
    assert {f.output_tokens for f in fin.values()} == {200}
    assert sum(f.preemptions for f in fin.values()) == e.stats().preemptions
    assert e.kv.num_free() == e.kv.capacity


def test_host_tier_offload_and_reload():
    e = EngineModel(PROFILE, kv_capacity_tokens=40 * BS, host_tier_tokens=200 * BS, noise=0, kv_events=True)
    pa = prompt(30 * BS, 1)
    e.add_request(SimRequest("a", pa, 1, output_len=1), 0.0)
    fa, _, now = drain(e)
    e.add_request(SimRequest("b", prompt(35 * BS, 2), 1, output_len=1), now)
    _, res, now = drain(e, now)
    cpu_stored = [ev for r in res for ev in r.events if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    assert cpu_stored and all(len(ev.token_ids) == BS * len(ev.block_hashes) for ev in cpu_stored)
    e.add_request(SimRequest("a2", pa, 1, output_len=1), now)
    f2, _, _ = drain(e, now)
    a2 = f2["a2"]
    assert a2.cached_tokens >= 20 * BS  # mostly reloaded from host rather than recomputed
    assert a2.transfer_s > 0
    assert e.stats().host_hits > 0
    assert (a2.first_token - a2.arrival) < (fa["a"].first_token - fa["a"].arrival)


def test_pd_hold_release_and_expiry():
    p = EngineModel(PROFILE, role="prefill", noise=0, kv_hold_timeout=5.0)
    p.add_request(SimRequest("x", prompt(1000), 1, hold_kv=True), 0.0)
    p.add_request(SimRequest("y", prompt(1000, 2), 1, hold_kv=True), 0.0)
    fin, _, now = {}, [], 0.0
    while len(fin) < 2:
        r = p.step(now)
        now = r.end
        fin.update({f.request_id: f for f in r.finished})
    assert fin["x"].output_tokens == 1 and fin["x"].kv_held
    held = p.held_kv("x")
    assert held.num_tokens == 1000 and held.num_blocks == -(-1000 // BS)
    used = p.kv.capacity - p.kv.num_free()
    assert p.release_kv("x") and p.held_kv("x") is None and not p.release_kv("x")
    assert p.kv.capacity - p.kv.num_free() < used
    assert p.next_timer() == pytest.approx(fin["y"].finished + 5.0)
    r = p.step(p.next_timer())
    assert r.expired == ["y"] and p.held_kv("y") is None and p.kv.num_free() == p.kv.capacity


def test_pd_decode_models_transfer_time():
    d = EngineModel(PROFILE, role="decode", noise=0)
    P = 4096
    d.add_request(SimRequest("z", prompt(P), 8, output_len=8, remote_kv=True), 0.0)
    r = d.step(0.0)
    assert r.idle and d.next_timer() is not None
    expected = (PROFILE.efficiency["transfer_latency_ms"] * 1e-3
                + P * PROFILE.kv_bytes_per_token / PROFILE.net_bytes_per_s)
    assert d.next_timer() == pytest.approx(expected)
    fin, res, _ = drain(d, 0.0)
    z = fin["z"]
    assert z.transfer_s == pytest.approx(expected)
    assert z.output_tokens == 8 and z.cached_tokens == P - 1
    assert sum(x.prefill_tokens for x in res) == 1  # only the last prompt token is recomputed
    assert [ev for x in res for ev in x.kv_loaded] == ["z"]


def test_roles_refuse_the_other_side():
    with pytest.raises(ValueError):
        EngineModel(PROFILE, role="decode").add_request(SimRequest("a", [1, 2], 1, hold_kv=True), 0.0)
    with pytest.raises(ValueError):
        EngineModel(PROFILE, role="prefill").add_request(SimRequest("a", [1, 2], 1, remote_kv=True), 0.0)
    with pytest.raises(ValueError, match="more KV blocks|maximum model length 64"):
        EngineModel(PROFILE, kv_capacity_tokens=64).add_request(SimRequest("a", prompt(100), 1), 0.0)


def _trace(seed: int):
    e = EngineModel(PROFILE, seed=seed, kv_capacity_tokens=200 * BS)
    for i in range(12):
        e.add_request(SimRequest(f"q{i}", prompt(300 + 37 * i, i), 80), 0.0)
    _, res, _ = drain(e)
    return [(r.duration, tuple(r.emitted)) for r in res]


def test_deterministic_for_a_seed():
    assert _trace(3) == _trace(3)
    assert _trace(3) != _trace(4)


def test_output_lengths_follow_a_capped_distribution():
    e = EngineModel(PROFILE, noise=0, median_output=64)
    for i in range(40):
        e.add_request(SimRequest(f"n{i}", prompt(50, i), 300), 0.0)
    e.add_request(SimRequest("capped", prompt(50), 3), 0.0)
    fin, _, _ = drain(e)
    lengths = [fin[f"n{i}"].output_tokens for i in range(40)]
    assert len(set(lengths)) > 10 and max(lengths) <= 300
    assert 20 < sorted(lengths)[20] < 200  # median near the configured 64
    assert all((f.reason == "length") == (f.output_tokens == 300) for k, f in fin.items() if k != "capped")
    assert fin["capped"].output_tokens <= 3


def test_abort_frees_kv_wherever_the_request_is():
    e = EngineModel(PROFILE, noise=0)
    e.add_request(SimRequest("run", prompt(500), 1000, output_len=1000), 0.0)
    now = 0.0
    for _ in range(5):
        now = e.step(now).end
    e.add_request(SimRequest("wait", prompt(500, 2), 10), now)
    assert e.stats().running == 1 and e.kv.num_free() < e.kv.capacity
    assert e.abort("run") and e.abort("wait") and not e.abort("run")
    assert not e.has_work() and e.kv.num_free() == e.kv.capacity


def test_step_time_grows_with_context_and_batch():
    t = EngineModel(PROFILE, noise=0).timer
    from engines_adapters.sim.timing import chunk_ctx
    one_chunk = t.duration(8192, 1, chunk_ctx(0, 8192), 0)
    late_chunk = t.duration(8192, 1, chunk_ctx(120_000, 8192), 0)
    assert late_chunk > 3 * one_chunk  # attention over a long context dominates
    d1, d128 = t.duration(1, 1, 0, 1024), t.duration(128, 128, 0, 128 * 1024)
    assert d1 < d128 < 10 * d1  # decode is memory bound: batching is cheap per token


def test_batch_256_decodes_every_sequence_every_step():
    """256 sequences reach decode together and each later step decodes all of them. What such a
    step costs in CPU is a figure of the machine: bench/sim_engine.py section 3 prints it."""
    e = EngineModel(PROFILE)
    for i in range(256):
        e.add_request(SimRequest(f"s{i}", prompt(200 + i, i), 5000, output_len=5000), 0.0)
    now = 0.0
    for _ in range(200):
        r = e.step(now)
        now = r.end
        if r.decode_seqs == 256:
            break
    assert e.stats().running == 256
    for _ in range(300):
        r = e.step(now)
        assert r.decode_seqs == 256 and not r.finished
        now = r.end


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_the_block_accounting_exact(seed):
    """Shared prefixes, tiny cache, host tier, aborts, PD holds: no block is lost or double-freed."""
    rng = random.Random(seed)
    e = EngineModel(PROFILE, role="both", kv_capacity_tokens=rng.choice([30, 60, 120]) * BS,
                    host_tier_tokens=rng.choice([0, 80 * BS]), max_num_batched_tokens=rng.choice([256, 1024]),
                    max_num_seqs=rng.choice([4, 16]), seed=seed, kv_events=True, kv_hold_timeout=0.5)
    bases = [prompt(rng.randrange(20, 300), 100 + k) for k in range(4)]
    now, live, n = 0.0, [], 0
    for _ in range(400):
        if n < 60 and rng.random() < 0.3:
            p = rng.choice(bases)[: rng.randrange(17, 400)] + prompt(rng.randrange(1, 60), rng.randrange(10**6))
            rid = f"q{n}"
            n += 1
            e.add_request(SimRequest(rid, p, rng.randrange(1, 80), output_len=rng.choice([None, 5, 40]),
                                     hold_kv=rng.random() < 0.15), now)
            live.append(rid)
        if live and rng.random() < 0.05:
            e.abort(live.pop(rng.randrange(len(live))))
        r = e.step(now)
        now = r.end if not r.idle else now + 0.01
        kv = e.kv
        referenced = [h for h, ref in kv.cached.items() if ref > 0]
        lru = list(kv.lru())
        assert len(lru) == len(set(lru)) == kv.n_lru
        assert set(lru) == {h for h, ref in kv.cached.items() if ref <= 0}
        assert len(kv.host) <= kv.host_capacity
        assert kv.meta is None or set(kv.meta) == set(kv.cached)
        private = sum(s.n_alloc - s.nb for s in e._seqs.values())
        assert kv.free_plain + len(kv.cached) + private == kv.capacity, "blocks leaked or double counted"
        assert len(referenced) <= kv.capacity
    _, _, now = drain(e, now)
    assert not e._seqs and e.kv.num_free() == e.kv.capacity


def test_output_that_would_outgrow_the_cache_is_refused_not_hung():
    """A sequence longer than the whole KV cache could never finish: refuse it up front."""
    from engines_adapters.sim.model import EngineModel, SimRequest
    from engines_adapters.sim.profiles import load_profile

    m = EngineModel(load_profile("llama3-8b-h200"), "both", kv_capacity_tokens=64, noise=0.0)
    assert m.max_model_len == 64
    with pytest.raises(ValueError, match="KV blocks"):
        m.add_request(SimRequest("r", list(range(40)), 100, output_len=100), 0.0)
    m.add_request(SimRequest("ok", list(range(40)), 20, output_len=20), 0.0)
    now, emitted = 0.0, 0
    for _ in range(200):  # bounded: it must finish
        res = m.step(now)
        now = res.end
        emitted += len(res.emitted)
        if not m.has_work():
            break
    assert emitted == 20 and not m.has_work()


@pytest.mark.parametrize("seed", range(6))
def test_kv_pool_lru_order_matches_an_ordered_dict(seed):
    """The pool's lazy-deletion LRU evicts exactly what an OrderedDict LRU would (trimming and
    re-stamping forced often by a tiny slack)."""
    from collections import OrderedDict

    from engines_adapters.sim.kv_cache import KVCache

    rng = random.Random(seed)
    kv = KVCache(40, BS)
    kv.slack = rng.choice([0, 1, 3])
    ref: dict[int, int] = {}
    lru: OrderedDict[int, None] = OrderedDict()
    free = 40
    held: list[tuple[list[int], int]] = []
    for _ in range(3000):
        if held and rng.random() < 0.45:  # a sequence ends
            hashes, n = held.pop(rng.randrange(len(held)))
            kv.release(hashes, n, 0)
            for h in reversed(hashes[:n]):
                ref[h] -= 1
                if ref[h] == 0:
                    lru[h] = None
        else:  # a sequence takes a prefix of one of a few chains (shared heads) and commits more
            chain = [rng.randrange(8) * 1000 + k for k in range(12)]
            g = kv.match_gpu(chain, 12)
            assert g == next((k for k, h in enumerate(chain) if h not in ref), 12)
            upto = min(12, g + rng.randrange(0, 5))
            kv.acquire(chain, g)  # as the engine: reference the hits, then allocate the rest
            for h in chain[:g]:
                if ref[h] == 0:
                    del lru[h]
                ref[h] += 1
            if not kv.alloc(upto - g):
                assert upto - g > free + len(lru)
                kv.release(chain, g, 0)
                for h in reversed(chain[:g]):
                    ref[h] -= 1
                    if ref[h] == 0:
                        lru[h] = None
                continue
            take = min(upto - g, free)
            free -= take
            for _ in range(upto - g - take):
                h, _ = lru.popitem(last=False)
                del ref[h]
            want = []
            for k in range(g, upto):  # a block whose content is cached already is shared
                h = chain[k]
                if h in ref:
                    if ref[h] == 0:
                        del lru[h]
                    ref[h] += 1
                    free += 1
                else:
                    ref[h] = 1
                    want.append(k)
            assert kv.commit_many(chain, g, upto) == want
            held.append((chain, upto))
        assert list(kv.lru()) == list(lru) and kv.n_lru == len(lru)
        assert {h: max(r, 0) for h, r in kv.cached.items()} == ref and kv.free_plain == free
    assert kv.evictions > 100


def test_step_duration_is_exactly_the_sum_of_its_operator_terms():
    """duration() inlines linear() and allreduce() for speed: bit for bit the same sum."""
    from engines_adapters.sim.profiles import profile_names
    from engines_adapters.sim.timing import StepTimer

    rng = random.Random(0)
    for name in profile_names():
        t = StepTimer(load_profile(name))
        if t._gap:  # a gap profile's step has more terms (tests/test_sim_gap.py)
            continue
        for _ in range(2000):
            tok = rng.randrange(1, 9000)
            seqs = rng.randrange(1, min(tok, 256) + 1)
            ctx, kv = rng.random() * 1e8, rng.randrange(0, 10**7)
            assert t.duration(tok, seqs, ctx, kv) == (t._overhead + t.linear(tok, seqs)
                                                      + ctx * t._attn_flops_per_ctx / t._attn_rate
                                                      + kv * t._kv_bytes / t._kv_rate + t.allreduce(tok))


@pytest.mark.parametrize("event_hashes", ["vllm", "index"])
def test_cache_salt_and_adapter_namespace_the_prefix_cache(event_hashes):
    """Issue 14: salts and LoRA adapters are separate prefix-cache namespaces (vLLM's extra keys);
    the events say which, and feed the gateway's hit index so it predicts exactly those hits."""
    from engines_adapters.kv_events import apply_events
    from scheduler.hashing import block_hashes, namespace_parent, vllm_block_hashes
    from scheduler.hit_index import HitIndex

    e = EngineModel(PROFILE, noise=0, kv_events=True, event_hashes=event_hashes)
    index = HitIndex(BS, trust_event_hashes=event_hashes == "index")
    index.register("e")
    p = prompt(20 * BS + 3)
    full = 20 * BS
    now, served, events = 0.0, {}, []
    for rid, salt, lora in [("a1", "a", None), ("b", "b", None), ("plain", None, None), ("a2", "a", None),
                            ("l1", None, "sql"), ("l2", None, "sql"), ("la", "a", "sql"), ("la2", "a", "sql")]:
        predicted = index.match(block_hashes(p, BS, parent=namespace_parent(salt, lora))).device.get("e", 0)
        e.add_request(SimRequest(rid, p, 1, output_len=1, cache_salt=salt, lora_name=lora), now)
        f, res, now = drain(e, now)
        served[rid] = (predicted * BS, f[rid].cached_tokens)
        new = [ev for r in res for ev in r.events]
        events += new
        apply_events(index, "e", new)
    assert served == {"a1": (0, 0), "b": (0, 0), "plain": (0, 0), "a2": (full, full),
                      "l1": (0, 0), "l2": (full, full), "la": (0, 0), "la2": (full, full)}
    roots = [ev for ev in events if isinstance(ev, BlockStored) and ev.parent_block_hash is None]
    la = roots[-1]
    assert la.lora_name == "sql" and la.lora_id and la.group_idx == 0
    assert la.extra_keys[:2] == [("sql", "a"), ("sql",)]
    if event_hashes == "vllm":
        assert la.block_hashes == vllm_block_hashes(p, BS, lora_name="sql", cache_salt="a")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("int_ids", [True, False])
def test_event_ids_follow_the_prefix_caching_hash_algo(algo, int_ids, monkeypatch):
    """--prefix-caching-hash-algo and VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, as vLLM: ids by the
    algorithm's recipe, as u64 ints or as the raw digests (32 bytes, or 16 for xxhash)."""
    from scheduler.hashing import vllm_block_digests, vllm_block_hashes

    monkeypatch.setenv("PYTHONHASHSEED", "")  # set but empty: a seed all the same, as in vLLM
    e = EngineModel(PROFILE, noise=0, kv_events=True, hash_algo=algo, int_block_hashes=int_ids)
    p = prompt(5 * BS + 1)
    e.add_request(SimRequest("a", p, 1, output_len=1), 0.0)
    _, res, _ = drain(e)
    ids = [h for r in res for ev in r.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
    want = vllm_block_hashes(p, BS, algo=algo, seed_text="") if int_ids else vllm_block_digests(p, BS, algo=algo)
    assert ids == want and len(ids) == 5
    assert int_ids or len(ids[0]) == (16 if algo.startswith("xxhash") else 32)


def test_xxhash_without_pythonhashseed_draws_a_private_seed_as_vllm(monkeypatch):
    from scheduler.hashing import vllm_block_hashes

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    ids = []
    for _ in range(2):
        e = EngineModel(PROFILE, noise=0, kv_events=True, hash_algo="xxhash")
        e.add_request(SimRequest("a", prompt(2 * BS), 1, output_len=1), 0.0)
        _, res, _ = drain(e)
        ids.append([h for r in res for ev in r.events if isinstance(ev, BlockStored) for h in ev.block_hashes])
    assert ids[0] != ids[1] and ids[0] != vllm_block_hashes(prompt(2 * BS), BS, algo="xxhash", seed_text="")
    with pytest.raises(ValueError, match="unknown prefix-caching hash algo"):
        EngineModel(PROFILE, kv_events=True, hash_algo="md5")
