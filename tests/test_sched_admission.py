"""Admission at the SLO boundary, Retry-After from drain time, per-request SLOs, early rejection."""
import math

import pytest

from predictors.telemetry import SLO
from scheduler import Instance, Placement, Rejection, RequestFacts, Scheduler
from scheduler.admission import resolve_slo
from scheduler.hashing import block_hashes
from scheduler.ledger import Reservation
from tests.sched_helpers import Clock, toks

BS = 16


def facts(rid, n=2000, max_tokens=200, slo=None, seed=1):
    t = toks(seed, n)
    return RequestFacts(rid, n, block_hashes(t, BS), max_tokens, slo)


def make(slo: SLO | None = None, **kw):
    clock = Clock(50.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], slo=slo or SLO(), clock=clock, **kw)
    return sched, clock


def queue(sched, seconds, n=1):
    now = sched.clock()
    for k in range(n):
        sched.ledger.reserve(Reservation(f"q{k}-{len(sched.ledger)}", "p0", "d0", 1000, seconds / n, 10, now,
                                         now + 1e5, now + 2e5), now)


def test_ttft_exactly_at_the_slo_is_admitted_and_a_hair_above_is_refused():
    probe, _ = make()
    queue(probe, 2.0)
    ttft = probe.evaluate(facts("r")).ttft_s
    at, _ = make(slo=SLO(ttft_s=ttft))
    queue(at, 2.0)
    assert isinstance(at.decide(facts("r")), Placement)
    below, _ = make(slo=SLO(ttft_s=math.nextafter(ttft, 0)))
    queue(below, 2.0)
    before = below.snapshot()["totals"]
    r = below.decide(facts("r"))
    assert isinstance(r, Rejection) and (r.status, r.reason) == (429, "ttft_slo")
    assert r.retry_after_s == 1.0  # ceil of the tiny excess, at least one second
    assert below.snapshot()["totals"]["reservations"] == before["reservations"]  # nothing reserved


def test_retry_after_is_the_queue_that_must_drain():
    sched, _ = make(slo=SLO(ttft_s=1.0))
    queue(sched, 7.3)
    r = sched.decide(facts("r"))
    ttft = r.explanation["terms"]["ttft_s"]
    assert r.reason == "ttft_slo" and r.retry_after_s == math.ceil(ttft - 1.0) >= 7
    assert r.explanation["violations"][0]["reason"] == "ttft_slo"


def test_a_prompt_no_idle_instance_can_prefill_in_time_is_unreachable():
    sched, _ = make(slo=SLO(ttft_s=0.05))
    r = sched.decide(facts("r", n=60_000))
    assert (r.status, r.reason, r.retry_after_s) == (429, "ttft_slo_unreachable", 1.0)  # nothing queued to drain
    queue(sched, 6.5)
    r = sched.decide(facts("s", n=60_000))
    assert (r.reason, r.retry_after_s) == ("ttft_slo_unreachable", 7.0)  # Retry-After: the queue's drain time


def test_tbt_boundary_and_retry_after_from_predicted_departures():
    probe, clock = make()
    now = clock()
    ends = [now + 3.2, now + 8.0, now + 20.0]
    for k, end in enumerate(ends):
        probe.ledger.reserve(Reservation(f"x{k}", "p0", "d0", 1, 0.0, 400_000, now, now, end), now)
    tbt = probe.evaluate(facts("r")).tbt_s
    at, _ = make(slo=SLO(tbt_s=tbt))
    below, _ = make(slo=SLO(tbt_s=math.nextafter(tbt, 0)))
    for s in (at, below):
        for k, end in enumerate(ends):
            s.ledger.reserve(Reservation(f"x{k}", "p0", "d0", 1, 0.0, 400_000, now, now, end), now)
    assert isinstance(at.decide(facts("r")), Placement)
    r = below.decide(facts("r"))
    assert (r.status, r.reason) == (429, "tbt_slo")
    assert r.retry_after_s == 4.0  # the first sequence to finish (in 3.2 s) brings TBT under the SLO


def test_tbt_unreachable_when_even_an_idle_decode_is_too_slow():
    sched, clock = make(slo=SLO(tbt_s=0.001))
    r = sched.decide(facts("r"))
    assert (r.status, r.reason, r.retry_after_s) == (429, "tbt_slo_unreachable", 1.0)
    now = clock()
    sched.ledger.reserve(Reservation("x", "p0", "d0", 1, 0.0, 100, now, now, now + 12.5), now)
    assert sched.decide(facts("s")).retry_after_s == 13.0  # when the decode instance will be empty


def test_both_violations_are_explained_and_the_reason_names_ttft():
    sched, clock = make(slo=SLO(ttft_s=0.5, tbt_s=0.0072))
    queue(sched, 3.0)
    now = clock()
    for k in range(40):
        sched.ledger.reserve(Reservation(f"x{k}", "p0", "d0", 1, 0.0, 10_000, now, now, now + 30), now)
    r = sched.decide(facts("r"))
    assert r.reason == "ttft_slo"
    assert [v["reason"] for v in r.explanation["violations"]] == ["ttft_slo", "tbt_slo"]


def test_per_request_slo_overrides_the_configured_one_field_by_field():
    assert resolve_slo(SLO(1.0, 0.1), None) == SLO(1.0, 0.1)
    assert resolve_slo(SLO(1.0, 0.1), SLO(tbt_s=0.2)) == SLO(1.0, 0.2)
    sched, _ = make(slo=SLO(ttft_s=0.001))
    assert sched.decide(facts("strict")).reason == "ttft_slo_unreachable"
    assert isinstance(sched.decide(facts("loose", slo=SLO(ttft_s=10.0))), Placement)
    assert sched.decide(facts("partial", slo=SLO(tbt_s=1.0))).reason == "ttft_slo_unreachable"


def test_no_slo_configured_admits_everything_that_fits():
    sched, _ = make()
    queue(sched, 1000.0)
    assert isinstance(sched.decide(facts("r")), Placement)


def test_prediction_based_early_rejection_counts_only_who_is_still_decoding_when_prefill_ends():
    """Mooncake §7.4: sequences predicted to finish before this prefill completes do not count."""
    def setup(early):
        sched, clock = make(slo=SLO(tbt_s=0.012), early_rejection=early)
        queue(sched, 4.0)  # this request's prefill finishes in > 4 s
        now = clock()
        for k in range(60):  # heavy decode load that drains within 3 s
            sched.ledger.reserve(Reservation(f"x{k}", "p0", "d0", 1, 0.0, 15_000, now, now, now + 3.0), now)
        return sched

    plain = setup(False).decide(facts("r"))
    assert isinstance(plain, Rejection) and plain.reason == "tbt_slo"
    sched = setup(True)
    running_now = sched.ledger.decode_state("d0", sched.clock()).running
    early = sched.decide(facts("r"))
    assert isinstance(early, Placement) and early.tbt_s < plain.explanation["terms"]["tbt_s"]
    assert early.decode_running == running_now == 61  # the placement reports the ledger as it is now
    assert early.explanation["early_rejection"] is True


def test_early_rejection_still_refuses_load_that_will_still_be_there():
    sched, clock = make(slo=SLO(tbt_s=0.012), early_rejection=True)
    now = clock()
    for k in range(60):
        sched.ledger.reserve(Reservation(f"x{k}", "p0", "d0", 1, 0.0, 15_000, now, now, now + 300.0), now)
    assert sched.decide(facts("r")).reason == "tbt_slo"


def test_late_rejection_admits_on_arrival_and_the_decode_side_refuses_after_the_prefill():
    """Mooncake's baseline without early rejection: TBT is not checked on arrival; at the end of
    the prefill the decode side counts only what it is decoding then (prefill done)."""
    sched, clock = make(slo=SLO(tbt_s=0.012), late_rejection=True)
    now = clock()
    for k in range(60):  # placed, still prefilling: the decode side does not see them yet
        sched.ledger.reserve(Reservation(f"x{k}", "p0", "d0", 1, 0.0, 15_000, now, now + 5, now + 300.0), now)
    placed = sched.decide(facts("r"))
    assert isinstance(placed, Placement)  # the arrival check would refuse it (see the early-rejection test)
    assert sched.admit_decode(facts("r"), "d0") is None  # nothing decoding on d0 yet
    for k in range(60):
        sched.prefill_done(f"x{k}")  # now they decode
    late = sched.admit_decode(facts("r"), "d0")
    assert isinstance(late, Rejection) and (late.status, late.reason) == (429, "tbt_slo")
    assert late.explanation["stage"] == "decode" and sched.counts["tbt_slo"] == 1
    assert "r" in sched.ledger  # the caller (the lifecycle) finishes it and releases


def test_late_rejection_off_never_refuses_at_the_decode_side():
    sched, clock = make(slo=SLO(tbt_s=0.012))
    now = clock()
    for k in range(60):
        sched.ledger.reserve(Reservation(f"x{k}", "p0", "d0", 1, 0.0, 15_000, now, now, now + 300.0), now)
        sched.prefill_done(f"x{k}")
    assert sched.admit_decode(facts("r"), "d0") is None


def test_early_and_late_rejection_exclude_each_other():
    with pytest.raises(ValueError, match="exclude"):
        make(early_rejection=True, late_rejection=True)


@pytest.mark.parametrize("policy", Scheduler.policy_names())
def test_admission_applies_to_every_policy(policy):
    clock = Clock(50.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], policy=policy, clock=clock,
                      slo=SLO(ttft_s=0.001))
    assert sched.decide(facts("r")).status == 429


def test_admission_off_places_what_it_would_refuse_and_says_so():
    """How the peer routers ship: no 429 for a predicted SLO miss; the explanation keeps the verdict."""
    on, _ = make(slo=SLO(ttft_s=1.0))
    queue(on, 5.0)
    assert isinstance(on.decide(facts("r")), Rejection)
    off, _ = make(slo=SLO(ttft_s=1.0), admission=False)
    queue(off, 5.0)
    d = off.decide(facts("r"))
    assert isinstance(d, Placement) and d.ttft_s > 5.0
    rec = d.explanation
    assert rec["outcome"] == "placed" and rec["admission"] is False and rec["violations"][0]["reason"] == "ttft_slo"
    assert "r" in off.ledger
