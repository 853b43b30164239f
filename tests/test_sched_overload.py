"""Overload admission by cost (scheduler/overload.py): the SJF threshold, its window, and how the
scheduler applies it (nothing reserved on a refusal, no effect below overload, deterministic)."""
import math

import pytest

from predictors.telemetry import SLO
from scheduler import Instance, Placement, Rejection, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from scheduler.overload import CostWindow, OverloadParams, split_params
from tests.sched_helpers import Clock, toks

BS = 16


def facts(rid, n, seed):
    return RequestFacts(rid, n, block_hashes(toks(seed, n), BS), 100)


# --- the window and its threshold ---------------------------------------------------------------
def window(eta=1.0, window_s=10.0):
    """A window that has seen traffic for a whole window already (its first arrival at 0, gone by 10)."""
    w = CostWindow(OverloadParams(enabled=True, eta=eta, window_s=window_s))
    w.add(0.0, 0.0, "warm-up")
    return w


def test_threshold_is_the_largest_cost_whose_cheaper_prefix_fits_the_capacity():
    w = window()
    for t, c in enumerate([5.0, 1.0, 4.0, 2.0, 3.0]):
        w.add(10.0 + t, c)
    assert w.demand_s == 15.0 and w.capacity_s(1, 5.0) == 10.0 and len(w) == 5
    assert w.threshold(1, 5.0) == 4.0  # 1 + 2 + 3 + 4 = 10 fits, + 5 does not
    assert w.threshold(2, 5.0) == math.inf  # 20 s of capacity: not overloaded
    w2 = window(eta=0.5)
    for t, c in enumerate([5.0, 1.0, 4.0, 2.0, 3.0]):
        w2.add(10.0 + t, c)
    assert w2.threshold(1, 5.0) == 2.0  # eta halves the capacity: 1 + 2 = 3 <= 5 < 6


def test_capacity_before_a_whole_window_is_over_the_time_since_the_first_arrival_or_the_slo():
    w = CostWindow(OverloadParams(enabled=True, eta=0.5, window_s=60.0))
    w.add(100.0, 1.0)
    assert w.capacity_s(4, 5.0) == 0.5 * 4 * 5.0  # just started: a queue may absorb one SLO of work
    w.expire(130.0)
    assert w.capacity_s(4, 5.0) == 0.5 * 4 * 30.0
    assert w.capacity_s(4, 45.0) == 0.5 * 4 * 45.0
    assert w.capacity_s(4, 5.0, at=500.0) == 0.5 * 4 * 60.0
    assert w.capacity_s(4, 90.0, at=500.0) == 0.5 * 4 * 60.0


def test_below_capacity_the_threshold_is_infinite_and_nothing_is_refused():
    w = window()
    for t in range(10):  # 1 s asked per second of one instance: fits
        verdict, info = w.check(f"r{t}", 1.0, 10.0 + t, 1, 2.0, record=True)
        assert verdict is None and info["threshold_s"] is None
    verdict, info = w.check("r10", 1.0, 20.0, 1, 2.0, record=True)  # the first has left: still 10 of 10
    assert verdict is None and info["threshold_s"] is None and info["demand_s"] == 10.0


def test_without_a_ttft_slo_there_is_no_overload():
    w = window()
    for t in range(50):
        verdict, info = w.check(f"r{t}", 5.0, 10.0 + t / 10, 1, None, record=True)
        assert verdict is None and info["counted"] is False
    assert len(w) == 0


def test_window_expiry_forgets_old_demand():
    w = window()
    w.add(10.0, 8.0)
    w.add(11.0, 8.0)
    assert w.threshold(1, 9.0) == 8.0
    v, _ = w.check("c", 9.0, 12.0, 1, 9.0, record=True)  # 25 s asked of 10
    assert v is not None and v.reason == "overloaded_cost"
    assert v.retry_after_s == 9.0  # without new arrivals, demand fits when the 2nd entry leaves at 21 s
    assert w.drain_s(12.0, 1, 9.0) == pytest.approx(9.0)
    w.expire(20.0)  # the first arrival (t=10) has left the window
    assert len(w) == 2 and w.demand_s == 17.0
    v, info = w.check("d", 9.0, 22.5, 1, 9.0, record=True)  # all three earlier arrivals are gone
    assert v is None and len(w) == 1 and info["demand_s"] == 9.0


def test_a_request_no_candidate_could_serve_in_time_is_not_demand():
    w = window()
    v, info = w.check("e", 20.0, 10.0, 1, 5.0, record=True)
    assert v is None and len(w) == 0 and info["counted"] is False


def test_params_any_policy_takes_them_and_every_policy_defaults_off():
    p, rest = split_params({"cost_admission": "off", "work_weight": "2", "cost_eta": "0.8"}, True)
    assert (p.enabled, p.eta, p.window_s) == (False, 0.8, OverloadParams().window_s) and rest == {"work_weight": "2"}
    with pytest.raises(ValueError, match="cost_eta"):
        split_params({"cost_eta": "0"}, True)
    with pytest.raises(ValueError, match="cost_window_s"):
        split_params({"cost_window_s": "-1"}, True)
    with pytest.raises(ValueError, match="cost_admission"):
        split_params({"cost_admission": "maybe"}, True)
    two = [Instance("p0", "prefill"), Instance("d0", "decode")]
    assert Scheduler(two, policy="conductor").overload is None  # opt-in (docs/scheduler.md says why)
    assert Scheduler(two, policy="conductor", cost_admission="on").overload is not None
    assert Scheduler(two, policy="conductor_alg1").overload is None  # Algorithm 1 as published
    assert Scheduler(two, policy="round_robin").overload is None
    assert Scheduler(two, policy="round_robin", cost_admission=True).overload is not None


# --- in the scheduler ---------------------------------------------------------------------------
def _overloaded(policy="conductor", **kw):
    """One prefill instance whose window (10 s, TTFT SLO 10 s) holds a long prefill and half a
    short one: alone, either fits; a long one behind a short one does not."""
    probe = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], policy=policy, clock=Clock(0.0),
                      cost_admission=False)
    short = probe.evaluate(facts("s", 500, 1)).prefill_s
    long = probe.evaluate(facts("l", 6000, 2)).prefill_s
    assert long > 2 * short
    clock = Clock(100.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], policy=policy, clock=clock,
                      slo=SLO(ttft_s=10.0), cost_admission=True, cost_window_s=10.0,
                      cost_eta=(long + 0.5 * short) / 10.0, **kw)
    sched.overload.add(90.0, 0.0, "warm-up")  # traffic for a whole window already: capacity is over 10 s
    return sched, clock, short


def test_a_long_prompt_past_capacity_is_refused_and_holds_nothing():
    sched, clock, short = _overloaded()
    assert isinstance(sched.decide(facts("a", 500, 1)), Placement)
    clock.t += 0.1
    r = sched.decide(facts("b", 6000, 2))
    assert isinstance(r, Rejection) and (r.status, r.reason) == (429, "overloaded_cost")
    assert r.retry_after_s is not None and r.retry_after_s >= 1
    assert "b" not in sched.ledger and len(sched.ledger) == 1 and len(sched.inflight) == 1
    rec = r.explanation
    assert rec["outcome"] == "rejected" and rec["reason"] == "overloaded_cost"
    assert rec["overload"]["threshold_s"] == pytest.approx(short) and rec["overload"]["counted"] is True
    assert "cheapest are admitted first" in r.message
    assert sched.decisions[-1] is rec and sched.counts["overloaded_cost"] == 1
    assert sched.release("b") is False  # nothing to give back
    # a short one is still admitted (its cost equals the threshold), the refused long one stays demand
    clock.t += 0.1
    assert isinstance(sched.decide(facts("c", 500, 3)), Placement)
    assert len(sched.overload) == 3


def test_expiry_lets_the_long_prompt_in_again():
    sched, clock, _ = _overloaded()
    sched.decide(facts("a", 500, 1))
    assert sched.decide(facts("b", 6000, 2)).reason == "overloaded_cost"
    sched.release("a")
    clock.t += 10.5  # both arrivals left the window; alone, the long prompt is 1 request of demand
    d = sched.decide(facts("b2", 6000, 2))
    assert isinstance(d, Placement) and d.explanation["overload"]["threshold_s"] is None


def test_evaluate_and_retries_do_not_count_as_new_demand():
    sched, clock, _ = _overloaded()
    sched.decide(facts("a", 500, 1))
    assert sched.evaluate(facts("b", 6000, 2)).reason == "overloaded_cost"
    assert len(sched.overload) == 1  # evaluate() judged it without keeping it
    d = sched.retry_excluding(facts("a", 500, 1), set())
    assert isinstance(d, Placement) and len(sched.overload) == 1


def test_admission_off_places_and_records_the_cost_verdict():
    sched, clock, _ = _overloaded(admission=False)
    sched.decide(facts("a", 500, 1))
    d = sched.decide(facts("b", 6000, 2))
    assert isinstance(d, Placement) and d.explanation["violations"][0]["reason"] == "overloaded_cost"


def test_no_effect_below_overload():
    """With a window that is never full, cost admission on decides exactly as off."""
    def run(on):
        clock = Clock(0.0)
        s = Scheduler([Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode")],
                      clock=clock, slo=SLO(ttft_s=2.0), cost_admission=on)
        out = []
        for k in range(40):
            clock.t = k * 1.5
            d = s.decide(facts(f"r{k}", 300 + 97 * (k % 7), k % 5))
            out.append((type(d).__name__, getattr(d, "prefill", None), getattr(d, "reason", None),
                        round(getattr(d, "ttft_s", 0.0), 9)))
            if k % 3 == 0:
                s.release(f"r{k - 3}")
        return out, s
    on, s_on = run(True)
    off, _ = run(False)
    assert on == off and any(x[0] == "Placement" for x in on)
    assert s_on.overload is not None and s_on.overload.threshold(2, 2.0) == math.inf


def test_deterministic_under_an_injected_clock():
    def run():
        sched, clock, _ = _overloaded(policy="round_robin")
        out = []
        for k in range(30):
            clock.t = 100.0 + 0.37 * k
            d = sched.decide(facts(f"r{k}", 400 + (k * 733) % 5000, k))
            out.append((type(d).__name__, getattr(d, "reason", None), getattr(d, "retry_after_s", None)))
        return out
    first = run()
    assert first == run()
    assert {x[1] for x in first} >= {None, "overloaded_cost"}
