"""Priority classes under overload (issue 14): a class admitted up to a smaller fraction of the
SLO is shed first, and the higher class keeps its attainment."""
import pytest

from predictors.telemetry import SLO
from scheduler import Instance, Placement, Rejection, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from tests.sched_helpers import Clock, toks

BS, PROMPT, OUT = 16, 2000, 50
HEADROOM = {"critical": 1.0, "sheddable": 0.5}


def run(headroom, classes=("critical", "sheddable"), overload=2.0, n=400, early_rejection=False):
    """Alternate the classes' requests at ``overload`` times what one prefill instance can take;
    retire each placed request when its predicted prefill and decode end. Placed and refused
    counts per class, the first refusal's class, and the worst predicted TTFT placed per class."""
    clock = Clock(0.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], clock=clock, block_size=BS,
                      priority_headroom=headroom, early_rejection=early_rejection)
    prefill_s = sched.evaluate(RequestFacts("probe", PROMPT, [], OUT)).prefill_s
    sched.slo = SLO(ttft_s=8 * prefill_s)
    gap = prefill_s / overload
    live: list[tuple[float, float, str]] = []  # (prefill end, decode end, id)
    stats = {c: {"placed": 0, "refused": 0, "worst_ttft": 0.0} for c in classes}
    first_refused = None
    for k in range(n):
        clock.t = k * gap
        for p_end, d_end, rid in list(live):
            if p_end <= clock.t:
                sched.prefill_done(rid)
            if d_end <= clock.t:
                sched.release(rid)
                live.remove((p_end, d_end, rid))
        cls = classes[k % len(classes)]
        t = toks(k + 1, PROMPT)  # no shared prefixes: every request pays its prefill
        d = sched.decide(RequestFacts(f"r{k}", PROMPT, block_hashes(t, BS), OUT, priority=cls, tenant=cls))
        if isinstance(d, Placement):
            stats[cls]["placed"] += 1
            stats[cls]["worst_ttft"] = max(stats[cls]["worst_ttft"], d.ttft_s)
            live.append((clock.t + d.ttft_s, clock.t + d.ttft_s + OUT * d.tbt_s, d.request_id))
        else:
            assert isinstance(d, Rejection) and d.status == 429
            stats[cls]["refused"] += 1
            first_refused = first_refused or cls
    return stats, first_refused, sched


@pytest.mark.parametrize("early", [False, True])
def test_lower_class_is_shed_first_and_the_higher_keeps_its_attainment(early):
    stats, first, sched = run(HEADROOM, early_rejection=early)
    crit, shed = stats["critical"], stats["sheddable"]
    assert first == "sheddable"
    # at twice the capacity, about half the requests fit: nearly all of them critical ones
    assert crit["placed"] >= 0.9 * (crit["placed"] + crit["refused"])
    assert shed["refused"] >= 0.8 * (shed["placed"] + shed["refused"])
    assert crit["worst_ttft"] <= sched.slo.ttft_s  # the critical requests placed are predicted in SLO
    assert shed["worst_ttft"] <= 0.5 * sched.slo.ttft_s  # a sheddable one only within its half
    # without classes, the same load is shed evenly: the critical class loses a large share
    even, _, _ = run({}, early_rejection=early)
    crit_even = even["critical"]
    assert crit_even["refused"] >= 0.3 * (crit_even["placed"] + crit_even["refused"])
    assert crit["placed"] > 1.5 * crit_even["placed"]


def test_records_carry_the_class_and_labels_and_unknown_classes_get_the_whole_slo():
    stats, _, sched = run(HEADROOM, n=60)
    rec = sched.decisions[-1]
    assert rec["tenant"] == rec["priority"] and rec["priority"] in HEADROOM
    refused = [r for r in sched.decisions if r["outcome"] == "rejected"]
    assert refused and all(r["priority"] == "sheddable" and r["admit_fraction"] == 0.5 for r in refused)
    # a class the scheduler was not told about is admitted up to the whole SLO, as no class at all
    same, _, _ = run({}, classes=("critical", "unlisted"), n=200)
    other, _, _ = run(HEADROOM, classes=("critical", "unlisted"), n=200)
    assert same == other


@pytest.mark.parametrize("bad", [{"low": 0}, {"low": 1.5}, {"low": True}, {"": 0.5}, {"low": "half"}])
def test_bad_headroom_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="priority_headroom"):
        Scheduler([Instance("a", "both")], priority_headroom=bad)


def test_requests_go_only_to_instances_serving_their_model_or_adapter():
    """Several models and LoRA adapters: an instance's served names (its /v1/models) bound where a
    request may go, prefill and decode side alike; unknown sets serve anything."""
    sched = Scheduler([Instance("pa", "prefill"), Instance("pb", "prefill"), Instance("da", "decode"),
                       Instance("db", "decode"), Instance("both", "both")], block_size=BS)

    def place(model, k):
        d = sched.decide(RequestFacts(f"m{k}", 64, block_hashes(toks(k, 64), BS), 4, model=model))
        return d if isinstance(d, Rejection) else (d.prefill, d.decode)

    assert sched.set_models("pa", ["base", "sql-lora"]) and sched.set_models("da", ["base", "sql-lora"])
    assert sched.set_models("pb", ["base"]) and sched.set_models("db", ["base"])
    assert sched.set_models("both", ["other"]) and not sched.set_models("both", ["other"])
    assert not sched.set_models("nope", ["x"])
    seen = {place("sql-lora", k) for k in range(30)}
    assert seen == {("pa", "da")}  # the adapter is loaded on pa and da only
    assert {place("other", k) for k in range(30, 40)} == {("both", "both")}
    base = {place("base", k) for k in range(40, 80)}
    assert {p for p, _ in base} <= {"pa", "pb"} and {d for _, d in base} <= {"da", "db"}
    r = place("missing", 99)
    assert isinstance(r, Rejection) and (r.status, r.reason) == (503, "model_not_served")
    assert place(None, 100) is not None  # no model named: anywhere
    sched.set_healthy("pa", False)
    r = place("sql-lora", 101)
    assert isinstance(r, Rejection) and r.reason == "model_not_served"
    sched.set_models("pb", None)  # forgotten: serves whatever it is asked (da still decodes it)
    assert place("sql-lora", 102) == ("pb", "da")
