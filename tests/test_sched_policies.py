"""Each policy's documented behaviour on small hand-built clusters."""
import math
from collections import Counter

import pytest

from predictors.analytic import DeploymentBook, analytic_predictors
from predictors.base import Predictors
from scheduler import SLO, Instance, Placement, Rejection, RequestFacts, Scheduler
from scheduler.explain import candidates
from scheduler.hashing import block_hashes
from scheduler.ledger import Reservation
from tests.sched_helpers import Clock, toks

BS = 16


def cluster(policy="conductor", prefill=3, decode=2, **kw):
    clock = Clock(100.0)
    insts = [Instance(f"p{i}", "prefill") for i in range(prefill)]
    insts += [Instance(f"d{i}", "decode") for i in range(decode)]
    return Scheduler(insts, policy=policy, clock=clock, block_size=BS, **kw), clock


def hold(sched, inst, tokens, medium="GPU"):
    """The instance reports (via a KV event named by its own ids) that it caches ``tokens``."""
    ours = block_hashes(tokens, BS)
    salt = hash(inst) & 0xFFFF
    assert sched.index.block_stored(inst, [h ^ salt for h in ours], None, tokens[:len(ours) * BS], BS, medium)


def facts(rid, tokens, max_tokens=128, slo=None):
    return RequestFacts(rid, len(tokens), block_hashes(tokens, BS), max_tokens, slo)


def busy(sched, inst, seconds, tokens=8000, decode="d1", n=1):
    """Queue ``n`` background prefills worth ``seconds`` in total on ``inst`` (ledger load only)."""
    now = sched.clock()
    for k in range(n):
        rid = f"bg-{inst}-{k}-{len(sched.ledger)}"
        sched.ledger.reserve(Reservation(rid, inst, decode, tokens // n, seconds / n, 100, now, now + 1e6, now + 2e6),
                             now)


# --- conductor (Algorithm 1) -----------------------------------------------------------------

def test_conductor_sends_a_hot_prefix_to_its_idle_holder():
    sched, _ = cluster()
    doc = toks(1, 6000)
    hold(sched, "p1", doc)
    d = sched.decide(facts("r", doc + toks(2, 300)))
    assert isinstance(d, Placement)
    assert (d.prefill, d.hit_tokens, d.local_hit_tokens) == ("p1", 6000, 6000)
    assert (d.transfer_tokens, d.transfer_from) == (0, None)
    assert d.ttft_s == pytest.approx(d.transfer_s + d.queue_s + d.prefill_s + d.kv_transfer_s + d.decode_first_step_s)


def test_conductor_moves_the_work_off_an_overloaded_holder_and_replicates_the_prefix():
    sched, _ = cluster()
    doc = toks(1, 6000)
    hold(sched, "p1", doc)
    busy(sched, "p1", seconds=5.0)
    d = sched.decide(facts("r", doc + toks(2, 300)))
    assert d.prefill in ("p0", "p2") and d.transfer_from == "p1" and d.transfer_tokens == 6000
    assert d.explanation["replication"] == {"source": "p1", "destination": d.prefill, "tokens": 6000,
                                            "blocks": [0, 375]}
    rows = {r["id"]: r for r in candidates(d.explanation, "prefill")}
    assert rows["p1"]["queue_s"] == pytest.approx(5.0) and rows["p1"]["ttft_s"] > rows[d.prefill]["ttft_s"]
    # the pull is worth it: its transfer is cheaper than the prefill it saves
    recompute = sched.predictors.prefill.prefill_time(d.prefill, 6300, 0)
    assert d.transfer_s < recompute - d.prefill_s


def test_conductor_without_peer_pull_only_pulls_from_the_store():
    """Engines that cannot fetch a prefix from another prefill instance (vLLM two-step PD with
    no shared store): the overloaded holder's prefix is not a source, the store still is."""
    sched, _ = cluster(peer_pull=False, inflight=False)  # the pull rule alone (no in-flight prefixes)
    doc = toks(1, 6000)
    hold(sched, "p1", doc)
    busy(sched, "p1", seconds=5.0)
    d = sched.decide(facts("r", doc + toks(2, 300)))
    assert d.prefill in ("p0", "p2") and (d.transfer_from, d.transfer_tokens, d.hit_tokens) == (None, 0, 0)
    rows = {r["id"]: r for r in candidates(d.explanation, "prefill")}
    assert all(rows[i]["transfer_from"] is None and rows[i]["hit_tokens"] == 0 for i in ("p0", "p2"))
    busy_with_r, idle = d.prefill, ({"p0", "p2"} - {d.prefill}).pop()
    # now the first 4000 tokens are also in the store: every instance without them pulls them from
    # there (4000 tokens move in ~10 ms, recomputing them costs far more), and the idle one wins
    hold(sched, "p1", doc[:4000], medium="EXTERNAL")
    d = sched.decide(facts("r2", doc + toks(3, 300)))
    assert d.prefill == idle
    assert (d.transfer_from, d.transfer_tokens, d.hit_tokens, d.local_hit_tokens) == ("store", 4000, 4000, 0)
    assert 0 < d.transfer_s < sched.predictors.prefill.prefill_time(idle, 6300, 0) - d.prefill_s
    rows = {r["id"]: r for r in candidates(d.explanation, "prefill")}
    assert (rows[busy_with_r]["transfer_from"], rows[busy_with_r]["transfer_tokens"]) == ("store", 4000)
    assert (rows["p1"]["transfer_from"], rows["p1"]["local_hit_tokens"]) == (None, 6000)  # its own prefix


def test_conductor_recomputes_when_the_network_is_slower_than_the_prefill_it_would_save():
    book = DeploymentBook()
    fast = analytic_predictors(book)

    class SlowNetwork:
        def transfer_time(self, tokens, source, destination):
            return 0.0 if tokens <= 0 or source == destination else 1e-3 * tokens  # 1 ms per token

    slow = Predictors(fast.queue, fast.prefill, SlowNetwork(), fast.tbt, fast.group)
    sched = Scheduler([Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode")],
                      clock=Clock(100.0), predictors=slow)
    for i in ("p0", "p1", "d0"):
        book.set(i, "llama3-8b-h200")
    doc = toks(1, 6000)
    hold(sched, "p1", doc)
    busy(sched, "p1", seconds=5.0, decode="d0")
    d = sched.decide(facts("r", doc + toks(2, 300)))
    assert d.prefill == "p0" and d.transfer_tokens == 0 and d.hit_tokens == 0  # recompute beats a 6 s pull


def test_conductor_ratio_rule_pulls_whenever_the_best_prefix_is_much_longer():
    sched, _ = cluster(pull_rule="ratio", balancing_threshold=1.5)
    doc = toks(1, 6400)
    hold(sched, "p0", doc[:1600])
    hold(sched, "p1", doc)
    busy(sched, "p1", seconds=5.0)
    busy(sched, "p2", seconds=5.0)
    d = sched.decide(facts("r", doc + toks(2, 100)))
    rows = {r["id"]: r for r in candidates(d.explanation, "prefill")}
    assert rows["p0"]["transfer_from"] == "p1" and rows["p0"]["transfer_tokens"] == 4800  # 6400/1600 > 1.5
    strict, _ = cluster(pull_rule="ratio", balancing_threshold=5.0)
    hold(strict, "p0", doc[:1600])
    hold(strict, "p1", doc)
    d = strict.decide(facts("r", doc + toks(2, 100)))
    rows = {r["id"]: r for r in candidates(d.explanation, "prefill")}
    assert rows["p0"]["transfer_tokens"] == 0 and rows["p2"]["transfer_from"] == "p1"  # p2 holds nothing: pulls


def test_conductor_long_prompt_goes_past_a_short_queue_on_the_instance_holding_a_small_prefix():
    sched, _ = cluster(prefill=2)
    long_prompt = toks(3, 32_000)
    hold(sched, "p0", long_prompt[:1024])
    busy(sched, "p0", seconds=0.4)
    d = sched.decide(facts("r", long_prompt))
    assert d.prefill == "p1" and d.transfer_from == "p0"  # 1k tokens move in ms; the queue costs 0.4 s
    prefix_only, _ = cluster("prefix_only", prefill=2)
    hold(prefix_only, "p0", long_prompt[:1024])
    busy(prefix_only, "p0", seconds=0.4)
    assert prefix_only.decide(facts("r", long_prompt)).prefill == "p0"  # longest match, load-blind


def test_conductor_pulls_from_the_shared_store():
    sched, _ = cluster()
    doc = toks(4, 4000)
    hold(sched, "p2", doc, medium="EXTERNAL")  # written to the store, not kept on p2's device
    d = sched.decide(facts("r", doc + toks(5, 200)))
    assert d.transfer_from == "store" and d.hit_tokens == 4000 and d.local_hit_tokens == 0


def test_conductor_decodes_where_tbt_is_lowest():
    sched, _ = cluster()
    now = sched.clock()
    for k in range(30):
        sched.ledger.reserve(Reservation(f"x{k}", "p0", "d0", 1, 0.0, 20_000, now, now, now + 100), now)
    d = sched.decide(facts("r", toks(6, 1000)))
    rows = {r["id"]: r for r in candidates(d.explanation, "decode")}
    assert d.decode == "d1" and rows["d0"]["tbt_s"] > rows["d1"]["tbt_s"] == d.tbt_s


def test_conductor_decodes_where_the_kv_fits_not_where_tbt_alone_is_lowest():
    """d0 has the lower TBT but no room for the prompt's KV until its one long decode ends: the
    request would wait there after its prefill. Conductor sends it to d1; the TTFT predicted on
    d0 includes that wait, whichever policy chose it."""
    def loaded(policy):
        insts = [Instance("p0", "prefill"), Instance("d0", "decode", kv_capacity_tokens=20_000),
                 Instance("d1", "decode", kv_capacity_tokens=400_000)]
        clock = Clock(100.0)
        sched = Scheduler(insts, policy=policy, clock=clock, block_size=BS)
        now = clock()
        sched.ledger.reserve(Reservation("long", "p0", "d0", 0, 0.0, 18_000, now, now, now + 60, output_tokens=10),
                             now)
        for k in range(40):  # d1 is busier (higher TBT) but has room
            sched.ledger.reserve(Reservation(f"x{k}", "p0", "d1", 0, 0.0, 2_000, now, now, now + 60, output_tokens=10),
                                 now)
        return sched

    d = loaded("conductor").decide(facts("r", toks(6, 8000)))
    rows = {r["id"]: r for r in candidates(d.explanation, "decode")}
    assert d.decode == "d1" and rows["d0"]["tbt_s"] < rows["d1"]["tbt_s"]
    assert rows["d0"]["score"] > 50 > rows["d1"]["score"]  # predicted first token on d0: after the long decode
    assert d.decode_wait_s == 0.0 and d.ttft_s < 5
    w = loaded("least_loaded").evaluate(facts("r", toks(6, 8000)))  # fewest running: d0, and it waits
    assert w.decode == "d0" and w.decode_wait_s > 50 and w.ttft_s > 50


# --- cache-blind baselines ---------------------------------------------------------------

def test_round_robin_rotates_and_skips_unhealthy_instances():
    sched, _ = cluster("round_robin")
    got = [sched.decide(facts(f"r{k}", toks(k, 100))) for k in range(6)]
    assert [d.prefill for d in got] == ["p0", "p1", "p2"] * 2
    assert [d.decode for d in got] == ["d0", "d1"] * 3
    sched.set_healthy("p1", False)
    assert [sched.decide(facts(f"s{k}", toks(k, 100))).prefill for k in range(4)] == ["p0", "p2", "p0", "p2"]


def test_random_is_reproducible_per_seed_and_request_and_spreads_load():
    a, _ = cluster("random", seed=7)
    b, _ = cluster("random", seed=7)
    picks = [a.decide(facts(f"r{k}", toks(k, 100))).prefill for k in range(60)]
    assert picks == [b.decide(facts(f"r{k}", toks(k, 100))).prefill for k in range(60)]
    assert set(Counter(picks)) == {"p0", "p1", "p2"}
    c, _ = cluster("random", seed=8)
    assert picks != [c.decide(facts(f"r{k}", toks(k, 100))).prefill for k in range(60)]


def test_least_loaded_ignores_the_cache():
    sched, _ = cluster("least_loaded")
    doc = toks(1, 6000)
    hold(sched, "p0", doc)
    busy(sched, "p0", seconds=0.01, tokens=50)
    busy(sched, "p1", seconds=0.01, tokens=20)
    busy(sched, "p2", seconds=0.01, tokens=30)
    d = sched.decide(facts("r", doc + toks(2, 100)))
    assert d.prefill == "p1" and d.hit_tokens == 0  # fewest queued tokens, the prefix on p0 ignored


# --- peer baselines ----------------------------------------------------------------------

def test_prefix_only_takes_the_longest_match_rotates_ties_and_falls_back_to_round_robin():
    sched, _ = cluster("prefix_only")
    doc = toks(1, 3200)
    hold(sched, "p0", doc[:1600])
    hold(sched, "p2", doc)
    busy(sched, "p2", seconds=60.0)  # load is invisible to it
    assert sched.decide(facts("a", doc + toks(9, 50))).prefill == "p2"
    hold(sched, "p1", doc)  # now p1 and p2 tie
    picks = [sched.decide(facts(f"t{k}", doc + toks(k, 50))).prefill for k in range(4)]
    assert picks == ["p1", "p2", "p1", "p2"]
    cold = [sched.decide(facts(f"c{k}", toks(100 + k, 500))).prefill for k in range(3)]
    assert cold == ["p0", "p1", "p2"]  # nobody holds anything: round robin
    decodes = [rec["chosen"]["decode"] for rec in sched.decisions]
    assert decodes == ["d0", "d1"] * 4  # decode is round robin throughout


def test_sglang_cache_aware_follows_its_own_routing_history():
    sched, _ = cluster("sglang_cache_aware")
    doc = toks(1, 3000)
    first = sched.decide(facts("a", doc + toks(2, 100)))  # empty tree: least loaded (first)
    busy(sched, first.prefill, seconds=1.0, n=5)  # more in flight there, still balanced (diff <= 64)
    again = sched.decide(facts("b", doc + toks(3, 100)))
    assert again.prefill == first.prefill  # affinity: match rate ~0.97 > 0.3, without any KV event
    assert again.explanation["why"]["extra"]["match_rate"] > 0.9
    other = sched.decide(facts("c", toks(4, 3000)))
    assert other.prefill != first.prefill  # no match: least loaded


def test_sglang_cache_aware_balances_when_load_is_skewed_past_both_thresholds():
    sched, _ = cluster("sglang_cache_aware", prefill=2)
    doc = toks(1, 3000)
    assert sched.decide(facts("a", doc)).prefill == "p0"
    busy(sched, "p0", seconds=1.0, n=70)  # 71 in flight vs 0: 71 > 64 and 71 > 1.5 x 0
    d = sched.decide(facts("b", doc + toks(2, 10)))
    assert d.prefill == "p1" and "imbalanced" in d.explanation["why"]["prefill"]
    sched2, _ = cluster("sglang_cache_aware", prefill=2, balance_abs_threshold=200)
    assert sched2.decide(facts("a", doc)).prefill == "p0"
    busy(sched2, "p0", seconds=1.0, n=70)
    assert sched2.decide(facts("b", doc + toks(2, 10))).prefill == "p0"  # within 200: affinity wins


def test_sglang_cache_aware_can_read_the_kv_event_index_instead():
    sched, _ = cluster("sglang_cache_aware", match_source="index")
    doc = toks(1, 3000)
    hold(sched, "p2", doc)
    assert sched.decide(facts("a", doc + toks(2, 100))).prefill == "p2"


def dynamo_cost(queued, prompt, device_blocks, host_blocks=0):
    return max(0.0, (queued + prompt) / BS - (1.0 * device_blocks + 0.75 * host_blocks))


def test_dynamo_cost_is_its_published_formula():
    sched, _ = cluster("dynamo_cost", prefill=2)
    doc = toks(1, 1600)
    hold(sched, "p0", doc)  # 100 blocks on p0
    busy(sched, "p0", seconds=1.0, tokens=5000)
    d = sched.decide(facts("r", doc + toks(2, 400)))  # 2000 tokens = 125 blocks
    scores = {r["id"]: r["score"] for r in candidates(d.explanation, "prefill")}
    assert scores == {"p0": pytest.approx(dynamo_cost(5000, 2000, 100)), "p1": pytest.approx(dynamo_cost(0, 2000, 0))}
    assert d.prefill == "p1"  # 337.5 > 125 blocks
    sched2, _ = cluster("dynamo_cost", prefill=2)
    hold(sched2, "p0", doc[:800])
    hold(sched2, "p0", doc, medium="CPU")  # blocks 50..99 only in host memory
    d = sched2.decide(facts("r", doc + toks(2, 400)))
    scores = {r["id"]: r["score"] for r in candidates(d.explanation, "prefill")}
    assert scores["p0"] == pytest.approx(dynamo_cost(0, 2000, 50, 50)) and d.prefill == "p0"
    dec = {r["id"]: r["score"] for r in candidates(d.explanation, "decode")}
    assert dec == {"d0": math.ceil(2000 / BS), "d1": math.ceil(2000 / BS)}  # potential decode blocks


def test_dynamo_cost_temperature_samples_instead_of_argmin():
    sched, _ = cluster("dynamo_cost", prefill=3, router_temperature=1.0)
    busy(sched, "p0", seconds=1.0, tokens=800)
    picks = Counter(sched.decide(facts(f"r{k}", toks(k, 800))).prefill for k in range(60))
    assert len(picks) > 1  # cheapest is not always taken


def test_lmetric_multiplies_uncached_tokens_by_batch():
    sched, _ = cluster("lmetric", prefill=2)
    doc = toks(1, 1504)
    hold(sched, "p0", doc)
    prompt = doc + toks(2, 496)  # 2000 tokens, 1504 cached on p0
    busy(sched, "p0", seconds=0.1, n=2)
    d = sched.decide(facts("a", prompt))
    assert d.prefill == "p0"  # 496 x 3 = 1488 < 2000 x 1
    busy(sched, "p0", seconds=0.1, n=2)  # now 5 in flight: 496 x 6 = 2976 > 2000
    assert sched.decide(facts("b", prompt)).prefill == "p1"


def test_every_policy_places_on_a_both_only_cluster_with_decode_on_the_same_instance():
    for name in Scheduler.policy_names():
        sched = Scheduler([Instance("a", "both"), Instance("b", "both")], policy=name, clock=Clock(100.0))
        for k in range(4):
            d = sched.decide(facts(f"{name}{k}", toks(k, 500)))
            assert isinstance(d, Placement), (name, d)
            assert d.decode == d.prefill and d.kv_transfer_s == 0.0


def test_ttft_slo_is_unreachable_only_when_no_candidate_could_meet_it_once_drained():
    """The chosen idle instance cannot meet the SLO, but the busy holder could once its queue
    drains: that is 'ttft_slo' (wait and retry), not 'unreachable'."""
    sched, _ = cluster(peer_pull=False)
    doc = toks(1, 6000)
    hold(sched, "p1", doc)
    busy(sched, "p1", seconds=5.0)
    req = doc + toks(2, 300)
    full = sched.predictors.prefill.prefill_time("p0", len(req), 0)
    tail = sched.predictors.prefill.prefill_time("p1", len(req), 6000)
    slo = SLO(ttft_s=(tail + full) / 2)  # between what the holder and a cold instance can do
    d = sched.decide(facts("r", req, slo=slo))
    assert isinstance(d, Rejection) and d.reason == "ttft_slo" and d.retry_after_s >= 1
    d = sched.decide(facts("r2", toks(9, 6300), slo=SLO(ttft_s=tail / 2)))  # nobody holds it
    assert isinstance(d, Rejection) and d.reason == "ttft_slo_unreachable"


def test_conductor_not_pulling_from_a_peer_still_loads_what_the_store_holds():
    """Ratio rule, local 10 blocks, store 18, peer 20: 20/10 is not above the threshold, so no
    peer pull, but the store's 18 blocks still load (an engine's store connector does that)."""
    sched, _ = cluster(pull_rule="ratio", balancing_threshold=2.0)
    doc = toks(1, 400)
    hold(sched, "p0", doc[:160])
    hold(sched, "p2", doc[:288], medium="EXTERNAL")
    hold(sched, "p1", doc[:320])
    d = sched.decide(facts("r", doc))
    rows = {r["id"]: r for r in candidates(d.explanation, "prefill")}
    assert rows["p0"]["transfer_from"] == "store" and rows["p0"]["hit_tokens"] == 288
    assert rows["p0"]["local_hit_tokens"] == 160
