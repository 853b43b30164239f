"""conductor's least work within SLO headroom (scheduler/policies/conductor_leastwork.py): among
the candidates predicted to meet headroom x the TTFT SLO, the one adding the least work wins; the
lowest predicted TTFT stands when none does, without a TTFT SLO, or when it adds the least work."""
import pytest

from scheduler import SLO, Placement
from scheduler.explain import candidates
from scheduler.policies import make_policy
from tests.sched_helpers import toks
from tests.test_sched_affinity import holder_behind
from tests.test_sched_policies import busy, cluster, facts


def midway(gap_s):
    """A TTFT SLO whose half lies midway between the predicted prefill TTFT of the cheapest
    candidate (which pulls p1's prefix) and the holder p1's (``gap_s`` behind it in score), and the
    decision without the rule."""
    plain, req = holder_behind(gap_s)
    d = plain.evaluate(req)
    rows = {r["id"]: r for r in candidates(d.explanation, "prefill")}
    assert rows["p1"]["ttft_s"] > rows[d.prefill]["ttft_s"] + gap_s  # the holder is slower by more than the gap
    return SLO(rows["p1"]["ttft_s"] + rows[d.prefill]["ttft_s"], None), d


def test_within_the_headroom_the_candidate_adding_the_least_work_wins():
    _, plain = midway(1.0)
    assert plain.prefill != "p1" and plain.transfer_from == "p1"  # cost alone: pull the prefix elsewhere
    sched, req = holder_behind(1.0, slo=SLO(20.0, None), least_work_headroom=0.5)
    d = sched.evaluate(req)
    assert isinstance(d, Placement)
    assert (d.prefill, d.local_hit_tokens, d.transfer_tokens) == ("p1", 6000, 0)  # no pull, no recompute
    assert d.ttft_s > plain.ttft_s  # slower for this request, within its headroom
    why = d.explanation["why"]["prefill"]  # the rule says it decided, and whom it overrode
    assert why.startswith("least work within 0.5x the TTFT SLO (10s)")
    assert f"lowest predicted TTFT {plain.prefill} " in why
    rows = {r["id"]: r for r in candidates(d.explanation, "prefill")}
    assert rows["p1"]["score"] > min(v["score"] for v in rows.values())  # the scores stay the cost model's


def test_outside_the_headroom_the_lowest_predicted_ttft_stands():
    slo, plain = midway(1.0)  # the cheapest fits in half the SLO, the holder does not
    sched, req = holder_behind(1.0, slo=slo, least_work_headroom=0.5)
    d = sched.evaluate(req)
    assert d.prefill == plain.prefill and d.transfer_from == "p1"
    assert d.explanation["why"]["prefill"].startswith("lowest predicted TTFT")
    # a headroom wide enough takes the holder back
    sched, req = holder_behind(1.0, slo=slo, least_work_headroom=1.0)
    assert sched.evaluate(req).prefill == "p1"


def test_the_request_own_tighter_slo_bounds_the_headroom():
    slo, plain = midway(1.0)
    sched, req = holder_behind(1.0, slo=SLO(20.0, None), least_work_headroom=0.5)
    assert sched.evaluate(req).prefill == "p1"
    sched, req = holder_behind(1.0, slo=SLO(20.0, None), least_work_headroom=0.5)
    tight = facts(req.request_id, toks(1, 6000) + toks(2, 300), slo=slo)
    d = sched.evaluate(tight)
    assert d.prefill == plain.prefill


def test_without_a_ttft_slo_the_rule_is_inert():
    sched, req = holder_behind(1.0, least_work_headroom=0.5)
    d = sched.evaluate(req)
    assert d.prefill != "p1" and d.explanation["why"]["prefill"].startswith("lowest predicted TTFT")


def test_when_the_lowest_ttft_adds_the_least_work_the_reason_is_unchanged():
    """No prefix anywhere: every candidate adds the same work, the fastest (idle) one wins, and the
    reason says so rather than crediting the rule."""
    sched, _ = cluster(slo=SLO(20.0, None), least_work_headroom=0.5)
    busy(sched, "p0", seconds=3.0)
    d = sched.evaluate(facts("r", toks(3, 4000)))
    assert d.prefill in ("p1", "p2")
    assert d.explanation["why"]["prefill"].startswith("lowest predicted TTFT")


def test_headroom_is_validated_and_off_by_default():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="least_work_headroom"):
            make_policy("conductor", least_work_headroom=bad)
    assert make_policy("conductor").params.least_work_headroom == 0.0
    assert make_policy("conductor_alg1").params.least_work_headroom == 0.0
