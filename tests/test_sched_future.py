"""conductor's future value (scheduler/follow_up.py, scheduler/policies/conductor_future.py): a
request bound to an instance by its prefix adds its work to that instance's decayed follow-up
load; a request with a new prefix adds future_weight x that load to each candidate's score."""
import math

import pytest

from scheduler import Placement
from scheduler.follow_up import FollowUpLoad
from scheduler.policies import make_policy
from tests.sched_helpers import toks
from tests.test_sched_policies import busy, cluster, facts, hold

# --- the state ---------------------------------------------------------------------------------


def test_follow_up_load_decays_exponentially_per_instance():
    fl = FollowUpLoad(tau_s=10.0)
    fl.add("p0", 2.0, now=100.0)
    fl.add("p1", 1.0, now=105.0)
    assert fl.value("p0", 100.0) == 2.0 and fl.value("p2", 100.0) == 0.0
    assert fl.value("p0", 110.0) == pytest.approx(2.0 / math.e)
    assert fl.value("p1", 115.0) == pytest.approx(1.0 / math.e)  # its own clock, not p0's
    assert fl.value("p0", 90.0) == 2.0  # an earlier reading never grows it
    fl.add("p0", 1.0, now=110.0)  # decayed to now, then added
    assert fl.value("p0", 110.0) == pytest.approx(2.0 / math.e + 1.0)
    assert set(fl.snapshot(110.0)) == {"p0", "p1"}
    with pytest.raises(ValueError, match="tau_s"):
        FollowUpLoad(0.0)


def test_off_by_default_and_validated():
    assert make_policy("conductor").follow_up is None
    assert make_policy("conductor", future_weight=0.5).follow_up is not None
    for bad in ({"future_weight": -1.0}, {"future_tau_s": 0.0}, {"future_new_share": 1.5}):
        with pytest.raises(ValueError, match="future_weight"):
            make_policy("conductor", **bad)


# --- the rule ------------------------------------------------------------------------------------

def follow_up_on_p1(**params):
    """p1 holds a conversation's 6000-token context; its next turn is placed there (bound by its
    prefix) and finishes. The scheduler, its clock and the follow-up load p1 then carries."""
    sched, clock = cluster(**params)
    doc = toks(1, 6000)
    hold(sched, "p1", doc)
    d = sched.decide(facts("turn", doc + toks(2, 600)))
    assert isinstance(d, Placement) and d.prefill == "p1" and d.local_hit_tokens == 6000
    sched.release("turn")  # its prefill is over: no queue left on p1
    load = sched.policy.follow_up.value("p1", clock()) if sched.policy.follow_up else 0.0
    return sched, clock, load


def test_a_bound_placement_adds_its_work_to_its_instance_only():
    sched, clock, load = follow_up_on_p1(future_weight=1.0)
    assert load > 0
    assert sched.policy.follow_up.snapshot(clock()) == {"p1": load}
    d = sched.evaluate(facts("new", toks(5, 4000)))  # an evaluation only: nothing added
    assert sched.policy.follow_up.snapshot(clock()) == {"p1": load}
    assert d.explanation["why"]["extra"]["follow_up_load_s"] == {"p1": load}


def test_a_new_prefix_avoids_the_instance_whose_follow_ups_are_due():
    plain, _, _ = follow_up_on_p1()
    sched, _, load = follow_up_on_p1(future_weight=2.0)
    for s in (plain, sched):  # the others carry a queue shorter than the term, longer than nothing
        busy(s, "p0", seconds=load * 0.5)
        busy(s, "p2", seconds=load * 0.5)
    new = facts("new", toks(5, 4000))
    assert plain.evaluate(new).prefill == "p1"  # greedy: the idle instance
    d = sched.evaluate(new)
    assert d.prefill in ("p0", "p2")
    why = d.explanation["why"]["prefill"]
    assert why.startswith("lowest predicted TTFT + 2 x follow-up load")
    assert " on p1," in why  # names the candidate it overrode
    rows = d.explanation["prefill"]
    score = dict(zip([r[0] for r in rows["rows"]], [r[-1] for r in rows["rows"]], strict=True))
    assert score["p1"] > score[d.prefill]  # the scores carry the term the reason names


def test_the_term_spares_a_follow_up_and_a_small_load():
    sched, _, load = follow_up_on_p1(future_weight=2.0)
    busy(sched, "p0", seconds=load * 0.5)
    busy(sched, "p2", seconds=load * 0.5)
    nxt = sched.evaluate(facts("next", toks(1, 6000) + toks(2, 600) + toks(3, 300)))
    assert nxt.prefill == "p1"  # bound by its prefix: no term, its reason is the cost model's
    assert nxt.explanation["why"]["prefill"].startswith("lowest predicted TTFT ")
    assert "follow_up_load_s" not in nxt.explanation["why"].get("extra", {})
    # the others' queues longer than the weighted load: the term does not change the choice
    calm, _, load = follow_up_on_p1(future_weight=0.5)
    busy(calm, "p0", seconds=load)
    busy(calm, "p2", seconds=load)
    d = calm.evaluate(facts("new", toks(5, 4000)))
    assert d.prefill == "p1" and d.explanation["why"]["prefill"].startswith("lowest predicted TTFT ")


def test_the_load_decays_and_the_instance_wins_new_prefixes_again():
    sched, clock, load = follow_up_on_p1(future_weight=2.0, future_tau_s=5.0)
    busy(sched, "p0", seconds=load * 0.5)
    busy(sched, "p2", seconds=load * 0.5)
    new = facts("new", toks(5, 4000))
    assert sched.evaluate(new).prefill != "p1"
    clock.t += 20.0  # four time constants: 2 x load x e^-4 < the others' queue (not yet drained)
    busy(sched, "p0", seconds=load * 0.5)
    busy(sched, "p2", seconds=load * 0.5)
    assert sched.evaluate(new).prefill == "p1"


def test_a_prefix_every_instance_holds_binds_nobody():
    """A system prompt on every instance: a request behind it is new (the term applies) and its
    placement adds no follow-up load."""
    sched, clock = cluster(future_weight=1.0)
    system = toks(7, 4096)
    for p in ("p0", "p1", "p2"):
        hold(sched, p, system)
    d = sched.decide(facts("first", system + toks(8, 500)))
    assert isinstance(d, Placement) and d.hit_tokens == 4096
    assert sched.policy.follow_up.snapshot(clock()) == {}
