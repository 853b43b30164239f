"""The Scheduler facade: the gateway's contract, bad input, lifecycle and bookkeeping."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from predictors.telemetry import SLO
from scheduler import Instance, Placement, Rejection, RequestFacts, Scheduler, format_lines
from scheduler.explain import DECODE_COLUMNS, PREFILL_COLUMNS, candidates
from scheduler.hashing import block_hashes
from tests.sched_helpers import Clock, toks

BS = 16


def facts(rid, n=1000, max_tokens=100, seed=1, slo=None):
    t = toks(seed, n)
    return RequestFacts(rid, n, block_hashes(t, BS), max_tokens, slo)


def pd(policy="conductor", **kw):
    clock = Clock(0.0)
    insts = [Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode"), Instance("d1", "decode")]
    return Scheduler(insts, policy=policy, clock=clock, **kw), clock


def test_policy_names_and_construction_errors():
    assert Scheduler.policy_names() == ["conductor", "conductor_alg1", "round_robin", "random", "least_loaded",
                                        "prefix_only", "sglang_cache_aware", "dynamo_cost", "lmetric"]
    with pytest.raises(ValueError, match="unknown policy"):
        Scheduler([Instance("a", "both")], policy="fastest")
    with pytest.raises(ValueError, match="no parameter"):
        Scheduler([Instance("a", "both")], policy="lmetric", cache_threshold=0.5)
    with pytest.raises(ValueError, match="duplicate"):
        Scheduler([Instance("a", "both"), Instance("a", "prefill")])
    with pytest.raises(ValueError, match="unknown deployment 'gpt-5-on-a-toaster'; known: "):
        Scheduler([Instance("a", "both", deployment="gpt-5-on-a-toaster")])
    with pytest.raises(ValueError):
        Instance("a", "router")
    with pytest.raises(ValueError):
        Instance("store", "prefill")  # reserved for the shared store


BAD = [
    (RequestFacts("r", 0, [], 10), 400, "empty_prompt"),
    (RequestFacts("r", -5, [], 10), 400, "empty_prompt"),
    (RequestFacts("r", 3.5, [], 10), 400, "bad_prompt_tokens"),
    (RequestFacts("r", True, [], 10), 400, "bad_prompt_tokens"),
    (RequestFacts("", 100, [], 10), 400, "bad_request_id"),
    (RequestFacts(None, 100, [], 10), 400, "bad_request_id"),
    (RequestFacts("r", 100, [], -1), 400, "bad_max_tokens"),
    (RequestFacts("r", 100, [1] * 7, 10), 400, "bad_block_hashes"),  # 100 tokens hold 6 blocks
    (RequestFacts("r", 100, "abc", 10), 400, "bad_block_hashes"),
    (RequestFacts("r", 100, [[1], [2]], 10), 400, "bad_block_hashes"),
    (RequestFacts("r", 100, [], 10, slo=SLO(ttft_s=-1)), 400, "bad_slo"),
    (RequestFacts("r", 100, [], 10, slo=SLO(tbt_s=math.nan)), 400, "bad_slo"),
    (RequestFacts("r", 100, [], 10, slo={"ttft_s": 1}), 400, "bad_slo"),
    (RequestFacts("r", 131_000, [], 1000), 400, "prompt_too_long"),
    ("not facts", 400, "bad_request"),
]


@pytest.mark.parametrize("bad,status,reason", BAD)
def test_bad_input_is_a_400_with_a_reason_and_touches_nothing(bad, status, reason):
    sched, _ = pd()
    r = sched.decide(bad)
    assert isinstance(r, Rejection) and (r.status, r.reason) == (status, reason) and r.message
    assert r.explanation["reason"] == reason and r.retry_after_s is None
    assert sched.ledger.is_idle()


def test_nothing_healthy_is_a_503_with_the_side_that_is_missing():
    sched, _ = pd()
    for i in ("d0", "d1"):
        sched.set_healthy(i, False)
    r = sched.decide(facts("r"))
    assert (r.status, r.reason) == (503, "no_healthy_decode")
    for i in ("p0", "p1"):
        sched.set_healthy(i, False)
    assert sched.decide(facts("r")).reason == "no_healthy_prefill"
    sched.set_healthy("p1", True)
    sched.set_healthy("d1", True)
    d = sched.decide(facts("r"))
    assert (d.prefill, d.decode) == ("p1", "d1")
    assert not sched.set_healthy("ghost", True)
    empty = Scheduler([], clock=Clock(0.0))
    assert empty.decide(facts("r")).reason == "no_healthy_prefill"


def test_a_both_instance_serves_when_prefill_only_instances_have_no_decode_peer():
    clock = Clock(0.0)
    sched = Scheduler([Instance("p", "prefill"), Instance("b", "both")], clock=clock)
    d = sched.decide(facts("r"))
    assert (d.prefill, d.decode, d.kv_transfer_s) == ("b", "b", 0.0)
    sched.set_healthy("b", False)
    assert sched.decide(facts("s")).reason == "no_healthy_decode"


def test_placement_carries_every_term_and_a_reservation_until_released():
    sched, clock = pd()
    d = sched.decide(facts("r", n=3000, max_tokens=500))
    assert isinstance(d, Placement)
    assert d.ttft_s == pytest.approx(d.transfer_s + d.queue_s + d.prefill_s + d.kv_transfer_s + d.decode_first_step_s)
    assert d.decode_first_step_s == d.tbt_s > 0  # the decode instance makes the first token
    assert d.kv_transfer_s > 0 and d.tbt_s > 0 and d.queue_s == 0 and d.queue_tokens == 0
    snap = {r["id"]: r for r in sched.snapshot()["instances"]}
    assert snap[d.prefill]["reserved_prefill_tokens"] == 3000 and snap[d.prefill]["active_requests"] == 1
    assert snap[d.decode]["kv_tokens"] == 3500 and snap[d.decode]["running"] == 1
    assert sched.decide(facts("r")).reason == "duplicate_request_id"
    # the next request sees the first in its instance's queue, and so goes to the idle one
    second = sched.evaluate(facts("s", seed=2))
    rows = {r["id"]: r for r in candidates(second.explanation, "prefill")}
    idle = ({"p0", "p1"} - {d.prefill}).pop()
    assert (rows[d.prefill]["queue_tokens"], rows[d.prefill]["queue_requests"]) == (3000, 1)
    assert rows[d.prefill]["queue_s"] > 0 and (rows[idle]["queue_tokens"], rows[idle]["queue_s"]) == (0, 0.0)
    assert second.prefill == idle and second.queue_tokens == 0
    clock.t += 0.01
    assert sched.prefill_done("r") and not sched.prefill_done("r")
    snap = {r["id"]: r for r in sched.snapshot()["instances"]}
    assert snap[d.prefill]["reserved_prefill_tokens"] == 0 and snap[d.decode]["running"] == 1
    assert sched.release("r") is True and sched.release("r") is False and sched.release("never") is False
    assert sched.ledger.is_idle()
    assert sched.decide(facts("r")).prefill  # the id is free again


def test_evaluate_reserves_nothing_and_advances_no_policy_state():
    sched, _ = pd("round_robin")
    first = sched.evaluate(facts("a"))
    assert sched.evaluate(facts("a")).prefill == first.prefill and sched.ledger.is_idle()
    assert len(sched.decisions) == 0
    assert sched.decide(facts("a")).prefill == first.prefill


def test_retry_excluding_releases_the_old_reservation_and_avoids_the_failed_instances():
    sched, _ = pd()
    doc = toks(9, 4000)
    ours = block_hashes(doc, BS)
    assert sched.index.block_stored("p0", [h + 1 for h in ours], None, doc, BS)
    f = RequestFacts("r", 4100, block_hashes(doc + toks(3, 100), BS), 100)
    first = sched.decide(f)
    assert first.prefill == "p0" and first.hit_tokens == 4000
    again = sched.retry_excluding(f, {"p0", first.decode})
    assert again.prefill == "p1" and again.decode != first.decode
    assert again.transfer_tokens == 0  # an excluded instance is no transfer source either
    assert len(sched.ledger) == 1
    assert sched.retry_excluding(f, {"p0", "p1"}).reason == "no_healthy_prefill"
    assert len(sched.ledger) == 0  # the failed retry released the old reservation too
    assert sched.retry_excluding(f, None).prefill == "p0"  # garbage exclusions mean none


def test_kv_events_for_unknown_or_removed_instances_are_refused_and_membership_changes_work():
    sched, _ = pd()
    doc = toks(2, 320)
    ours = block_hashes(doc, BS)
    assert not sched.index.block_stored("ghost", ours, None, doc, BS)
    assert sched.add_instance(Instance("p2", "prefill"))
    assert not sched.add_instance(Instance("p2", "decode"))
    assert sched.index.block_stored("p2", ours, None, doc, BS)
    d = sched.decide(RequestFacts("r", 400, block_hashes(doc + toks(4, 80), BS), 10))
    assert d.prefill == "p2"
    assert sched.remove_instance("p2") and not sched.remove_instance("p2")
    assert not sched.index.block_stored("p2", ours, None, doc, BS)
    assert sched.release("r")  # a reservation on a removed instance is still released once
    assert not sched.release("r")
    assert sched.decide(facts("s")).prefill in ("p0", "p1")


def test_calls_with_foreign_ids_are_refused_not_raised():
    sched, _ = pd()
    for bad in (None, 3, ["p0"], {"p0": 1}):
        assert sched.release(bad) is False and sched.prefill_done(bad) is False
        assert sched.set_healthy(bad, False) is False and sched.remove_instance(bad) is False
        assert sched.observe_load(bad, running=1, waiting=0, kv_usage=0.1) is False
        assert sched.index.block_stored(bad, [1], None, list(range(16)), 16) is False
        assert sched.index.block_removed(bad, [1]) is False
        sched.index.all_cleared(bad)
        sched.index.drop_instance(bad)
    assert isinstance(sched.decide(facts("r")), Placement)


def test_observed_load_reconciles_the_view():
    sched, _ = pd("least_loaded")
    assert sched.observe_load("d0", running=50, waiting=0, kv_usage=0.6)
    assert not sched.observe_load("ghost", running=1, waiting=0, kv_usage=0.1)
    d = sched.decide(facts("r"))
    assert d.decode == "d1"  # d0 is busy with work we did not place
    rows = {r["id"]: r for r in candidates(d.explanation, "decode")}
    assert rows["d0"]["running"] == 50 and rows["d0"]["tbt_s"] > rows["d1"]["tbt_s"]


def test_explanations_hold_every_candidate_and_render_one_line_each():
    sched, _ = pd(keep_decisions=3)
    for k in range(5):
        last = sched.decide(facts(f"r{k}", seed=k))
    assert [rec["request_id"] for rec in sched.decisions] == ["r2", "r3", "r4"]  # bounded, latest last
    rec = sched.decisions[-1]
    assert rec["prefill"]["columns"] == PREFILL_COLUMNS and rec["decode"]["columns"] == DECODE_COLUMNS
    rows = candidates(rec, "prefill")
    assert [r["id"] for r in rows] == ["p0", "p1"]
    for r in rows:
        assert r["ttft_s"] == pytest.approx(r["transfer_s"] + r["queue_s"] + r["prefill_s"])
    assert rec["chosen"] == {"prefill": last.prefill, "decode": last.decode}
    assert rec["why"]["prefill"] and rec["why"]["decode"]
    lines = format_lines(rec)
    assert len(lines) == 1 + 2 + 2 + 1 and lines[-1].startswith("placed on")
    assert any(line.startswith("* prefill") for line in lines) and any(line.startswith("* decode") for line in lines)
    rej = Scheduler([Instance("p", "prefill"), Instance("d", "decode")], clock=Clock(0.0),
                    slo=SLO(ttft_s=1e-6)).decide(facts("x"))
    assert format_lines(rej.explanation)[-1].startswith("rejected (ttft_slo_unreachable)")
    empty = pd()[0].decide(RequestFacts("y", 0, [], 1))
    assert format_lines(empty.explanation)[-1].startswith("rejected (empty_prompt)")


def test_full_hits_leave_the_last_token_to_compute():
    sched, _ = pd()
    doc = toks(5, 320)  # exactly 20 blocks
    sched.index.block_stored("p1", block_hashes(doc, BS), None, doc, BS)
    d = sched.decide(RequestFacts("r", 320, block_hashes(doc, BS), 10))
    assert d.prefill == "p1" and d.hit_tokens == 304  # 19 blocks: block 20 holds the last prompt token


def test_snapshot_shape():
    sched, _ = pd()
    sched.decide(facts("r"))
    snap = sched.snapshot()
    assert {"instances", "totals", "index_mb"} <= set(snap)
    row = snap["instances"][0]
    assert {"id", "role", "deployment", "kv_capacity_tokens", "max_model_len", "healthy", "reserved_prefill_tokens",
            "reserved_prefill_s", "active_requests",
            "kv_tokens", "cached_blocks"} <= set(row)
    assert set(row["cached_blocks"]) == {"device", "host", "store"}
    assert snap["totals"]["reservations"] == 1 and snap["totals"]["decisions"]["placed"] == 1


def test_a_bug_inside_a_policy_becomes_a_500_rejection_not_an_exception():
    sched, _ = pd()

    def broken(ctx):
        raise RuntimeError("boom")

    sched.policy.choose_prefill = broken
    r = sched.decide(facts("r"))
    assert (r.status, r.reason) == (500, "internal_error") and "boom" in r.message
    assert sched.ledger.is_idle()


junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3),
                 st.lists(st.integers(-2, 2**64), max_size=3))
facts_strategy = st.builds(
    RequestFacts,
    request_id=st.one_of(st.text(max_size=8), junk),
    prompt_tokens=st.one_of(st.integers(-10, 140_000), junk),
    block_hashes=st.one_of(st.lists(st.integers(0, 2**64 - 1), max_size=80), junk,
                           st.lists(junk, max_size=5)),
    max_tokens=st.one_of(st.integers(-5, 5000), junk),
    slo=st.one_of(st.none(), st.builds(SLO, st.one_of(st.none(), st.floats()), st.one_of(st.none(), st.floats()))),
)


@settings(max_examples=300, deadline=None)
@given(facts_strategy, st.sampled_from(Scheduler.policy_names()))
def test_decide_never_raises_and_answers_with_a_defined_status(f, policy):
    sched, _ = pd(policy)
    d = sched.decide(f)
    if isinstance(d, Rejection):
        assert d.status in (400, 429, 503) and d.reason and d.reason != "internal_error"
        assert sched.ledger.is_idle()
    else:
        assert d.request_id == f.request_id and len(sched.ledger) == 1
        assert sched.release(f.request_id)
    assert sched.ledger.is_idle()


step = st.one_of(
    st.tuples(st.just("decide"), st.integers(0, 7), st.integers(1, 20_000), st.integers(0, 2000)),
    st.tuples(st.just("prefill_done"), st.integers(0, 7)),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("retry"), st.integers(0, 7), st.sampled_from(["p0", "p1", "d0", "d1"])),
    st.tuples(st.just("health"), st.sampled_from(["p0", "p1", "d0", "d1", "b"]), st.booleans()),
    st.tuples(st.just("tick"), st.floats(0, 5)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(step, max_size=30), st.sampled_from(Scheduler.policy_names()), st.booleans())
def test_ledger_returns_to_zero_after_any_interleaving(steps, policy, early):
    clock = Clock(0.0)
    insts = [Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode"), Instance("d1", "decode"),
             Instance("b", "both")]
    sched = Scheduler(insts, policy=policy, clock=clock, early_rejection=early, slo=SLO(ttft_s=30.0, tbt_s=0.2))
    placed = set()
    for s in steps:
        if s[0] == "decide":
            d = sched.decide(facts(f"r{s[1]}", n=s[2], max_tokens=s[3], seed=s[1]))
            if isinstance(d, Placement):
                placed.add(d.request_id)
        elif s[0] == "prefill_done":
            sched.prefill_done(f"r{s[1]}")
        elif s[0] == "release":
            assert sched.release(f"r{s[1]}") == (f"r{s[1]}" in placed)
            placed.discard(f"r{s[1]}")
        elif s[0] == "retry":
            placed.discard(f"r{s[1]}")
            d = sched.retry_excluding(facts(f"r{s[1]}", seed=s[1]), {s[2]})
            if isinstance(d, Placement):
                placed.add(d.request_id)
        elif s[0] == "health":
            sched.set_healthy(s[1], s[2])
        else:
            clock.t += s[1]
        assert len(sched.ledger) == len(placed)
    for rid in placed:
        assert sched.release(rid)
    assert sched.ledger.is_idle()
    totals = sched.snapshot()["totals"]
    assert totals["reservations"] == totals["reserved_prefill_tokens"] == totals["running"] == totals["kv_tokens"] == 0


def test_capacity_from_config_or_the_engine_replaces_the_public_estimate():
    from predictors.base import DecodeState
    from predictors.facts import load_deployment

    sched = Scheduler([Instance("a", "both", max_model_len=2048, kv_capacity_tokens=500_000)], clock=Clock(0.0))
    row = sched.snapshot()["instances"][0]
    assert (row["deployment"], row["kv_capacity_tokens"], row["max_model_len"]) == ("llama3-8b-h200", 500_000, 2048)
    assert isinstance(sched.decide(facts("long", n=4000)), Rejection)  # longer than the configured context
    tbt_before = sched.predictors.tbt.tbt(DecodeState("a", 10, 100_000), 100, 10)
    assert sched.set_capacity("a", kv_capacity_tokens=50_000, max_model_len=8192)  # what the engine reports
    row = sched.snapshot()["instances"][0]
    assert (row["kv_capacity_tokens"], row["max_model_len"]) == (50_000, 8192)
    assert isinstance(sched.decide(facts("long2", n=4000)), Placement)
    # the predictors learned it too: a step reads at most the smaller cache, the rest waits for room
    assert sched.predictors.tbt.tbt(DecodeState("a", 10, 100_000), 100, 10) < 0.85 * tbt_before
    assert not sched.set_capacity("a", kv_capacity_tokens=50_000)  # nothing changed
    assert not sched.set_capacity("zz", kv_capacity_tokens=1) and not sched.set_capacity("a", kv_capacity_tokens=-3)
    est = Scheduler([Instance("b", "both")]).snapshot()["instances"][0]
    d = load_deployment("llama3-8b-h200")
    assert (est["kv_capacity_tokens"], est["max_model_len"]) == (d.estimated_kv_capacity_tokens(), d.max_model_len)
    with pytest.raises(ValueError):
        Instance("c", "both", kv_capacity_tokens=0)


def test_a_mixed_fleet_never_pairs_across_protocols():
    clock = Clock(0.0)
    insts = [Instance("vp", "prefill", protocol="vllm"), Instance("vd", "decode", protocol="vllm"),
             Instance("sp", "prefill", protocol="sglang"), Instance("sd", "decode", protocol="sglang")]
    sched = Scheduler(insts, policy="round_robin", clock=clock)
    pairs = set()
    for i in range(12):
        d = sched.decide(facts(f"r{i}", seed=i))
        pairs.add((d.prefill, d.decode))
        sched.release(f"r{i}")
    assert pairs == {("vp", "vd"), ("sp", "sd")}
    sched.set_healthy("sd", False)  # the SGLang prefill has no decode of its protocol left
    for i in range(6):
        d = sched.decide(facts(f"s{i}", seed=i))
        assert (d.prefill, d.decode) == ("vp", "vd")
        sched.release(f"s{i}")
    sched.set_healthy("vd", False)
    assert sched.decide(facts("t")).reason == "no_healthy_decode"


def test_the_stores_own_answer_replaces_the_indexs_store_walk():
    """Engines announce what they wrote to the store (medium ``cpu``) but not what it evicted: when
    the gateway's store tier answered from the store itself, that answer is the store's part of
    the decision (and the index's store walk is skipped); without one, the index's is."""
    s, _ = pd()
    f = facts("a", n=1000)
    s.index.block_stored("p0", f.block_hashes[:40], None, toks(1, 1000)[:40 * BS], BS, "cpu")
    s.decide(f)
    assert s.decisions[-1]["store_hit_tokens"] == 40 * BS  # no store tier: the engines' events
    g = facts("b", n=1000)
    g.store_blocks = 12  # the store tier: it evicted the rest
    s.decide(g)
    assert s.decisions[-1]["store_hit_tokens"] == 12 * BS
