"""What the decision's hot path keeps between decisions is never served stale: the ledger's
cached views follow every reservation change, and a learned predictor group that an online
correction moves is read afresh by the next decision (Predictors.groups)."""
from __future__ import annotations

import pytest
from learned_helpers import DEPLOYMENT, synth_records

from predictors.calibrate import calibrate
from predictors.learned import learned_predictors
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.explain import candidates
from scheduler.hashing import block_hashes
from tests.sched_helpers import Clock, toks

BS = 16


def facts(rid, n=2000, seed=1, max_tokens=200):
    return RequestFacts(rid, n, block_hashes(toks(seed, n), BS), max_tokens)


def rows(d, side):
    return {r["id"]: r for r in candidates(d.explanation, side)}


def test_a_reservation_placed_or_released_changes_the_next_decisions_terms():
    clock = Clock(0.0)
    insts = [Instance(f"p{k}", "prefill") for k in range(3)] + [Instance(f"d{k}", "decode") for k in range(3)]
    sched = Scheduler(insts, clock=clock, block_size=BS, policy="least_loaded")
    first = sched.decide(facts("a", seed=1))
    assert isinstance(first, Placement)
    clock.t = 0.001
    seen = sched.evaluate(facts("b", seed=2))
    assert rows(seen, "decode")[first.decode]["running"] == 1 and rows(seen, "decode")[first.decode]["kv_tokens"] > 0
    queued = rows(seen, "prefill")[first.prefill]
    assert queued["queue_requests"] == 1 and queued["queue_s"] > 0
    sched.prefill_done("a")  # the prefill queue empties, the decode stays
    seen = sched.evaluate(facts("b", seed=2))
    assert rows(seen, "prefill")[first.prefill]["queue_requests"] == 0
    assert rows(seen, "decode")[first.decode]["running"] == 1
    sched.release("a")
    seen = sched.evaluate(facts("b", seed=2))
    assert all(r["running"] == 0 and r["kv_tokens"] == 0 for r in rows(seen, "decode").values())
    assert all(r["queue_requests"] == 0 and r["queue_s"] == 0 for r in rows(seen, "prefill").values())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("models"))
    calibrate(synth_records(300, seed=3), d, draw=False)
    return d


def test_a_moved_predictor_group_is_read_by_the_next_decision(models):
    pred = learned_predictors(models, alpha=0.2)
    insts = [Instance(f"p-{k}", "prefill", deployment=DEPLOYMENT) for k in (1, 2, 3)]
    insts += [Instance("d-1", "decode", deployment=DEPLOYMENT)]
    sched = Scheduler(insts, clock=Clock(0.0), block_size=BS, predictors=pred)
    before = sched.evaluate(facts("x"))
    prefill_s = {k: r["prefill_s"] for k, r in rows(before, "prefill").items()}
    assert len(set(prefill_s.values())) == 1 and pred.groups is not None
    assert pred.groups["p-1"] is pred.groups["p-2"]  # one shared group: its terms computed once
    for rec in synth_records(60, seed=4):  # p-1 prefills 1.5x slower than its model, when idle
        rec.prefill_end_s = rec.prefill_start_s + 1.5 * pred.bundle.prefill_base("p-1", rec.prompt_tokens,
                                                                                 rec.hit_tokens)
        rec.token_times, rec.first_token_s = [], None
        pred.observe(rec)
    assert pred.groups["p-1"] != pred.groups["p-2"]
    after = rows(sched.evaluate(facts("x")), "prefill")
    assert after["p-1"]["prefill_s"] == pytest.approx(1.5 * after["p-2"]["prefill_s"], rel=0.02)
    assert after["p-2"]["prefill_s"] == after["p-3"]["prefill_s"] == prefill_s["p-2"]
    sched.remove_instance("p-3")
    assert "p-3" not in pred.groups
