"""Ledger: reservations add up to the load, are released exactly once, and leave nothing behind."""
import math

import pytest
from hypothesis import example, given, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from predictors.base import PrefillState
from scheduler.ledger import Ledger, Reservation

INSTANCES = ("p0", "p1", "d0", "both")


def res(rid, prefill, decode, tokens=100, secs=0.5, kv=300, now=0.0, decode_s=2.0):
    return Reservation(rid, prefill, decode, tokens, secs, kv, now, now + secs, now + secs + decode_s)


class LedgerMachine(RuleBasedStateMachine):
    """Any interleaving of reserve / prefill_done / release (complete or abort)."""

    ids = Bundle("ids")

    def __init__(self):
        super().__init__()
        self.ledger = Ledger()
        for i in INSTANCES:
            self.ledger.add_instance(i, kv_capacity_tokens=10_000, typical_prefill_s=0.1)
        self.now = 0.0
        self.live: dict[str, Reservation] = {}
        self.released: set[str] = set()
        self.n = 0

    @rule(target=ids, pair=st.sampled_from([("p0", "d0"), ("p1", "d0"), ("p0", "both"), ("both", "both")]),
          tokens=st.integers(1, 5000), secs=st.floats(0.001, 5.0), kv=st.integers(1, 9000),
          dt=st.floats(0, 1.0))
    def reserve(self, pair, tokens, secs, kv, dt):
        self.now += dt
        self.n += 1
        rid = f"r{self.n}"
        r = res(rid, pair[0], pair[1], tokens, secs, kv, self.now)
        assert self.ledger.reserve(r, self.now)
        assert not self.ledger.reserve(res(rid, "p1", "d0"), self.now)  # duplicate id: refused, no change
        self.live[rid] = r
        return rid

    @rule(rid=ids, dt=st.floats(0, 1.0))
    def prefill_done(self, rid, dt):
        self.now += dt
        was_pending = rid in self.live and self.live[rid].prefill_pending
        assert self.ledger.prefill_done(rid, self.now) == was_pending
        assert not self.ledger.prefill_done(rid, self.now)  # idempotent

    @rule(rid=consumes(ids), dt=st.floats(0, 1.0))
    def release(self, rid, dt):
        self.now += dt
        assert self.ledger.release(rid, self.now) == (rid not in self.released)
        assert not self.ledger.release(rid, self.now)  # exactly once
        self.released.add(rid)
        self.live.pop(rid, None)

    @rule()
    def unknown_ids_are_ignored(self):
        assert not self.ledger.release("nope", self.now)
        assert not self.ledger.prefill_done("nope", self.now)

    @invariant()
    def counters_equal_the_live_reservations(self):
        for i in INSTANCES:
            pending = [r for r in self.live.values() if r.prefill == i and r.prefill_pending]
            decoding = [r for r in self.live.values() if r.decode == i]
            t = self.ledger.instance_totals(i)
            assert t["reserved_prefill_tokens"] == sum(r.prefill_tokens for r in pending)
            assert t["reserved_prefill_s"] == pytest.approx(sum(r.prefill_s for r in pending), abs=1e-9)
            assert t["running"] == len(decoding)
            assert t["kv_tokens"] == sum(r.kv_tokens for r in decoding)
            touching = {r.request_id for r in pending} | {r.request_id for r in decoding}
            assert t["active_requests"] == len(touching)
            assert self.ledger.prefill_state(i, self.now).queued_requests == len(pending)

    @invariant()
    def views_in_one_call_follow_every_change(self):
        """The batched views (the decision's hot loop) equal the single ones and the live
        reservations: a decode view cached since the last change is never served stale."""
        states = self.ledger.decode_states(INSTANCES, self.now)
        pstates, actives = self.ledger.prefill_views(INSTANCES, self.now)
        for i, s, ps, a in zip(INSTANCES, states, pstates, actives, strict=True):
            decoding = [r for r in self.live.values() if r.decode == i]
            assert (s.running, s.kv_tokens) == (len(decoding), sum(r.kv_tokens for r in decoding))
            assert s == self.ledger.decode_state(i, self.now)
            assert (ps, a) == self.ledger.prefill_view(i, self.now) and type(ps) is PrefillState
            pending = [r for r in self.live.values() if r.prefill == i and r.prefill_pending]
            assert ps.queued_tokens == sum(r.prefill_tokens for r in pending) and ps.queued_requests == len(pending)

    def teardown(self):
        for rid in list(self.live):
            assert self.ledger.release(rid, self.now)
        assert self.ledger.is_idle()  # every counter back to exactly zero, no float residue


TestLedgerInterleavings = LedgerMachine.TestCase
TestLedgerInterleavings.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_queue_time_credits_the_head_for_time_already_spent():
    ledger = Ledger()
    ledger.add_instance("p")
    ledger.reserve(res("a", "p", "p", secs=2.0), now=10.0)
    ledger.reserve(res("b", "p", "p", secs=3.0), now=10.0)
    assert ledger.prefill_state("p", 10.0).queued_s == pytest.approx(5.0)
    assert ledger.prefill_state("p", 11.5).queued_s == pytest.approx(3.5)  # a is 1.5 s in
    assert ledger.prefill_state("p", 20.0).queued_s == pytest.approx(3.0)  # credit stops at a's prediction
    ledger.prefill_done("a", now=12.0)  # b starts its turn now
    assert ledger.prefill_state("p", 13.0).queued_s == pytest.approx(2.0)
    ledger.prefill_done("b", now=14.0)
    assert ledger.prefill_state("p", 14.0).queued_s == 0.0


def test_out_of_order_completion_keeps_the_heads_credit():
    ledger = Ledger()
    ledger.add_instance("p")
    ledger.reserve(res("a", "p", "p", secs=2.0), now=0.0)
    ledger.reserve(res("b", "p", "p", secs=3.0), now=0.0)
    ledger.prefill_done("b", now=1.0)  # batched: b finished first
    assert ledger.prefill_state("p", 1.5).queued_s == pytest.approx(0.5)


def test_observed_metrics_raise_the_view_never_lower_it_and_expire():
    ledger = Ledger(observe_ttl_s=5.0)
    ledger.add_instance("d", kv_capacity_tokens=1000, typical_prefill_s=0.2)
    ledger.reserve(res("a", "d", "d", kv=300), now=0.0)
    assert ledger.observe("d", running=4, waiting=3, kv_usage=0.5, now=0.0)
    s = ledger.decode_state("d", 1.0)
    assert (s.running, s.kv_tokens) == (4, 500)
    assert ledger.prefill_state("d", 0.0).queued_s == pytest.approx(0.5 + 2 * 0.2)  # 2 queued we did not place
    ledger.observe("d", running=0, waiting=0, kv_usage=0.0, now=2.0)
    s = ledger.decode_state("d", 2.0)
    assert (s.running, s.kv_tokens) == (1, 300)  # our own reservation still counts
    ledger.observe("d", running=9, waiting=0, kv_usage=0.9, now=2.0)
    assert ledger.decode_state("d", 7.5).running == 1  # observation older than the TTL is ignored
    assert not ledger.observe("ghost", running=1, waiting=0, kv_usage=0.1, now=0.0)
    assert not ledger.observe("d", running=-1, waiting=0, kv_usage=0.1, now=0.0)
    assert not ledger.observe("d", running=1, waiting=0, kv_usage=1.5, now=0.0)
    assert not ledger.observe("d", running="x", waiting=0, kv_usage=0.1, now=0.0)


def test_decode_load_predicted_at_a_future_time():
    ledger = Ledger()
    ledger.add_instance("p")
    ledger.add_instance("d")
    # a decodes in [1, 3), b in [2, 10), c in [12, 20)
    for rid, start, end in (("a", 1, 3), ("b", 2, 10), ("c", 12, 20)):
        ledger.reserve(Reservation(rid, "p", "d", 10, 0.1, 100, 0.0, start, end), now=0.0)
    assert ledger.decode_state("d", 0.0).running == 3  # reserved view: everyone placed
    assert ledger.decode_state_at("d", 2.5, now=0.0).running == 2  # a and b decoding
    assert ledger.decode_state_at("d", 5.0, now=0.0).running == 1  # a has left, c not yet in
    assert ledger.decode_state_at("d", 15.0, now=0.0).kv_tokens == 100
    assert [r.request_id for r in ledger.decode_departures("d")] == ["a", "b", "c"]


def test_prefill_done_makes_the_decode_start_actual():
    ledger = Ledger()
    ledger.add_instance("p")
    ledger.add_instance("d")
    ledger.reserve(Reservation("a", "p", "d", 10, 0.1, 100, 0.0, 5.0, 9.0), now=0.0)
    ledger.prefill_done("a", now=1.0)
    r = ledger.get("a")
    assert (r.decode_start_s, r.decode_end_s) == (1.0, 5.0)


def test_release_after_the_instance_left_is_still_exactly_once():
    ledger = Ledger()
    ledger.add_instance("p")
    ledger.add_instance("d")
    ledger.reserve(res("a", "p", "d"), now=0.0)
    ledger.remove_instance("d")
    ledger.add_instance("d")  # re-registered: starts empty, the old reservation must not underflow it
    assert ledger.release("a", now=1.0) and not ledger.release("a", now=1.0)
    assert ledger.is_idle()


def test_decode_running_late_still_counts_for_early_rejection():
    from scheduler.ledger import Ledger, Reservation

    led = Ledger()
    led.add_instance("p0")
    led.add_instance("d0")
    led.reserve(Reservation("r", "p0", "d0", 100, 0.1, 500, 0.0, 1.0, 2.0), now=0.0)
    assert led.decode_state_at("d0", 1.5, now=0.5).running == 1  # decoding as predicted
    assert led.decode_state_at("d0", 3.0, now=0.5).running == 0  # predicted to be done by then
    assert led.decode_state_at("d0", 3.0, now=2.5).running == 1  # past its end, still held: late


def test_observe_rejects_impossible_numbers_without_raising():
    from scheduler.ledger import Ledger

    led = Ledger()
    led.add_instance("d0")
    assert not led.observe("d0", float("inf"), 0, 0.5, now=0.0)
    assert not led.observe("d0", 1, float("nan"), 0.5, now=0.0)
    assert led.observe("d0", 3, 1, 0.5, now=0.0)


def test_decode_kv_wait_is_the_first_departure_that_makes_room():
    led = Ledger(fifo_decode=False)  # the sweep (decode_fifo=off)
    led.add_instance("d", kv_capacity_tokens=10_000)
    assert led.decode_kv_wait("d", 4000, 0.0, 0.0) == 0.0  # empty: room now
    # two decodes holding 4000-token prompts and 1000 output tokens each, ending at 10 s and 20 s
    led.reserve(Reservation("a", "p", "d", 0, 0.0, 5000, 0.0, 0.0, 10.0, output_tokens=1000), 0.0)
    led.reserve(Reservation("b", "p", "d", 0, 0.0, 5000, 0.0, 0.0, 20.0, output_tokens=1000), 0.0)
    assert led.decode_kv_wait("d", 1500, 0.0, 0.0) == 0.0  # 8000 in use at t=0 (outputs not yet generated)
    assert led.decode_kv_wait("d", 4000, 0.0, 0.0) == pytest.approx(10.0)  # room when "a" ends
    assert led.decode_kv_wait("d", 4000, 12.0, 0.0) == pytest.approx(12.0)  # not before the KV is ready
    assert led.decode_kv_wait("d", 9000, 0.0, 0.0) == pytest.approx(20.0)  # needs both gone
    led.release("a", 1.0)
    assert led.decode_kv_wait("d", 4000, 0.0, 1.0) == 0.0
    led.add_instance("unknown-capacity")
    assert led.decode_kv_wait("unknown-capacity", 10**9, 0.0, 0.0) == 0.0


def _kv_wait_by_definition(led, iid, need, t0, now):
    """decode_kv_wait written as its definition: every candidate time, every reservation."""
    d = led._loads[iid]
    cap = d.kv_capacity_tokens
    if d.kv_tokens + need <= cap:
        return 0.0
    t0 = max(t0, now)  # room at a past instant is no room now
    ends = sorted({t0, *(r.decode_end_s for r in d.decoding.values() if r.decode_end_s > t0)})
    for t in ends:
        used = 0.0
        for r in d.decoding.values():
            if r.decode_start_s > t or now < r.decode_end_s <= t:
                continue
            span = r.decode_end_s - r.decode_start_s
            done = 1.0 if span <= 0 else min(1.0, max(0.0, (t - r.decode_start_s) / span))
            used += r.kv_tokens - r.output_tokens * (1.0 - done)
        if used + need <= cap:
            return max(0.0, t - now)
    return max(0.0, ends[-1] - now)


# derandomize fixes the seed, not the sample: Hypothesis also draws constants found in every
# imported project module, so which other tests are collected (or any edit) changes it. The
# cases that broke the sweep once are therefore pinned as examples: a span too short for
# a + b t (rate x start swamped the sum; a subnormal span overflowed it to nan), and KV
# ready before now (the sweep looked at room at a past instant).
@settings(max_examples=200, deadline=None, derandomize=True)
@example([(0.0, 0.0, 1, 0), (0.0, 0.0, 1, 0), (0.0, 0.0, 1, 915), (0.0, 0.0, 2285, 1950), (0.0, 0.0, 693, 366),
          (0.0, 0.0, 1005, 620), (0.0, 0.0, 3994, 2000), (1.0, 1.0, 1, 0), (0.0, 2.0, 2168, 1),
          (0.0, 1.175494351e-38, 1, 1)], 4000, 1.0, 0.0)
@example([(0.0, 0.0, 1, 177), (0.0, 0.0, 1, 1439), (0.0, 0.0, 56, 366), (0.0, 0.0, 6, 79), (0.0, 0.0, 175, 95),
          (0.0, 0.0, 450, 160), (0.0, 0.0, 577, 183), (0.0, 0.0, 239, 240), (0.0, 0.0, 535, 358),
          (0.0, 0.0, 1101, 398), (0.0, 0.0, 1045, 464), (0.0, 0.0, 515, 479), (0.0, 0.0, 829, 641),
          (0.0, 0.0, 702, 983), (0.0, 1.0, 1166, 110), (0.0, 2.2250738585e-313, 440, 1)], 5990, 0.0, 0.0)
@example([(0.0, 10.0, 4000, 2000)], 15500, 0.0, 5.0)
@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 50), st.integers(1, 4000), st.integers(0, 2000)),
                max_size=30),
       st.integers(1, 8000), st.floats(0, 60), st.floats(0, 10))
def test_decode_kv_wait_sweep_matches_its_definition(rs, need, t0, now):
    led = Ledger(fifo_decode=False)  # the sweep (decode_fifo=off)
    led.add_instance("d", kv_capacity_tokens=20_000)
    for k, (start, span, prompt, out) in enumerate(rs):
        led.reserve(Reservation(f"r{k}", "p", "d", 0, 0.0, prompt + out, 0.0, start, start + span,
                                output_tokens=out), 0.0)
    assert led.decode_kv_wait("d", need, t0, now) == pytest.approx(_kv_wait_by_definition(led, "d", need, t0, now),
                                                                  abs=1e-6)


def test_decode_load_is_reservations_per_instance_averaged_over_time_and_a_burst_does_not_move_it():
    led = Ledger()
    for i in ("d0", "d1"):
        led.add_instance(i)
    assert led.decode_load(2, 0.0) == 0.0
    for k in range(8):  # a burst: eight requests placed in the same instant
        led.reserve(Reservation(f"r{k}", "p", f"d{k % 2}", 10, 0.1, 100, 0.0, 0.2, 1.0), 0.0)
        assert led.decode_load(2, 0.0) == 0.0
    # a second later the average has moved 1 - e^-1 of the way to the level (8 / 2 instances)
    assert led.decode_load(2, 1.0) == pytest.approx(4.0 * (1 - math.exp(-1.0)))
    later = led.decode_load(2, 30.0)
    assert later == pytest.approx(4.0, rel=1e-6)
    for k in range(8):
        led.release(f"r{k}", 30.0)
    assert led.decode_load(2, 31.0) == pytest.approx(4.0 * math.exp(-1.0), rel=1e-6)
    assert led.decode_load(0, 31.0) == pytest.approx(4.0 * math.exp(-1.0), rel=1e-6)  # no instance: no division
