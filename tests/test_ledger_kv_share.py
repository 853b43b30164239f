"""``decode_share`` (scheduler/ledger.py ``_learn_kv_share``): a decode engine keeps a prefix its
running sequences share once, while each step reads every sequence's whole context. The ledger
learns the device KV per context token from the engine's reported KV usage against the reservations
it has seen start decoding (their first token), and the TBT predictors read a full cache as that
much more context (docs/predictors.md, "Shared prefixes on a full decode cache")."""
from __future__ import annotations

import pytest

from predictors.analytic import analytic_predictors
from predictors.base import DecodeState
from predictors.telemetry import SLO, RequestRecord
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from scheduler.ledger import KV_SHARE_ALPHA, Ledger, Reservation
from scheduler.lifecycle import RequestLifecycle
from tests.sched_helpers import Clock, toks

CAP = 100_000


def _ledger(learn: bool = True, n: int = 10, admitted: int = 5) -> Ledger:
    """``n`` reservations of 10,000 tokens on "d" (capacity 100,000), the first ``admitted`` decoding."""
    led = Ledger(learn_kv_share=learn)
    led.add_instance("d", kv_capacity_tokens=CAP)
    for k in range(n):
        led.reserve(Reservation(f"r{k}", "p", "d", 0, 0.0, 10_000, 0.0, 0.0, 10.0, prefill_pending=False), 0.0)
    for k in range(admitted):
        assert led.decode_started(f"r{k}", 1.0)
    return led


def test_the_share_is_learned_from_kv_usage_against_the_admitted_reservations():
    led = _ledger()
    assert led.decode_state("d", 1.0).kv_share == 1.0  # nothing observed yet
    led.observe("d", running=5, waiting=0, kv_usage=0.3, now=1.0)  # 30,000 in use for 50,000 of context
    assert led.decode_state("d", 1.0).kv_share == pytest.approx(1.0 + KV_SHARE_ALPHA * (0.6 - 1.0))
    for t in range(2, 40):
        led.observe("d", running=5, waiting=0, kv_usage=0.3, now=float(t))
    state = led.decode_state("d", 40.0)
    assert state.kv_share == pytest.approx(0.6, abs=1e-3)
    assert state.kv_tokens == 100_000  # the context every reservation holds, as before
    assert led.decode_states(["d"], 40.0)[0].kv_share == state.kv_share
    assert led.decode_state_at("d", 5.0, 40.0).kv_share == state.kv_share


def test_no_sample_without_admitted_reservations_nor_with_the_option_off():
    led = _ledger(admitted=0)  # all ten still waiting for their first token: nothing to compare with
    led.observe("d", running=0, waiting=10, kv_usage=0.3, now=1.0)
    assert led.decode_state("d", 1.0).kv_share == 1.0
    off = _ledger(learn=False)
    for t in range(1, 10):
        off.observe("d", running=5, waiting=0, kv_usage=0.3, now=float(t))
    assert off.decode_state("d", 10.0).kv_share == 1.0


def test_a_sample_is_never_above_one():
    led = _ledger()
    for t in range(1, 20):  # more in use than the admitted context: loads in flight, not sharing
        led.observe("d", running=5, waiting=0, kv_usage=0.9, now=float(t))
    assert led.decode_state("d", 20.0).kv_share == 1.0


def test_decode_started_marks_once_and_ignores_unknown_ids():
    led = _ledger(admitted=0)
    assert led.decode_started("r0", 2.0) and not led.decode_started("r0", 3.0)
    assert led.get("r0").admitted_s == 2.0
    assert not led.decode_started("nobody", 2.0)


def test_a_full_cache_of_shared_context_steps_slower_and_a_cache_with_room_the_same():
    tbt = analytic_predictors().tbt
    cap = analytic_predictors().tbt.book.keyed("d")[1].kv_capacity_tokens
    full = DecodeState("d", 299, 3 * cap)  # three capacities of context reserved
    alone, shared = tbt.tbt(full, 1000, 100), tbt.tbt(full._replace(kv_share=0.5), 1000, 100)
    assert shared > 1.5 * alone  # the cache holds twice the context, and each step reads it
    roomy = DecodeState("d", 9, cap // 10)
    assert tbt.tbt(roomy._replace(kv_share=0.5), 1000, 100) == tbt.tbt(roomy, 1000, 100)


def _world():
    clock = Clock(0.0)
    insts = [Instance("p", "prefill"), Instance("d", "decode", kv_capacity_tokens=CAP)]
    return Scheduler(insts, policy="round_robin", slo=SLO(), block_size=16, clock=clock), clock


def _facts(rid: str, n: int = 2000, max_tokens: int = 100) -> RequestFacts:
    return RequestFacts(rid, n, block_hashes(toks(hash(rid) % 1000, n), 16), max_tokens)


def test_the_first_token_marks_the_reservation_admitted():
    sched, clock = _world()
    lc = RequestLifecycle(sched, RequestRecord("a", 0.0), clock)
    assert isinstance(lc.decide(_facts("a")), Placement)
    lc.prefill_started()
    clock.t = 0.5
    lc.prefill_finished()
    assert sched.ledger.get("a").admitted_s < 0
    clock.t = 0.6
    lc.token()
    assert sched.ledger.get("a").admitted_s == 0.6
    lc.token()  # later tokens change nothing
    assert sched.ledger.get("a").admitted_s == 0.6


def test_a_reservation_spans_the_step_of_whole_contexts_and_admission_sees_the_shared_step():
    """The decode wait's replay holds whole contexts against the capacity: room frees at the right
    rate with the step of the batch that fits so (kv_share 1). Admission's TBT is the true step."""
    sched, clock = _world()
    for k in range(30):  # 3x the capacity reserved, all decoding
        assert isinstance(sched.decide(_facts(f"f{k}", 9_900)), Placement)
        sched.prefill_done(f"f{k}")
        sched.decode_started(f"f{k}")
    for t in range(1, 30):
        clock.t = t / 100
        sched.observe_load("d", running=30, waiting=0, kv_usage=1.0)  # 100,000 in use for ~300,000 of context
    share = sched.ledger.decode_state("d", clock.t).kv_share
    assert 0.3 < share < 0.4
    p = sched.decide(_facts("new"))
    assert isinstance(p, Placement)
    tbt = sched.predictors.tbt
    before = sched.ledger.decode_state("d", clock.t)  # one more now: the state it was decided on, less itself
    state = before._replace(running=before.running - 1, kv_tokens=before.kv_tokens - 2100)
    true, whole = tbt.tbt(state, 2000, 100), tbt.tbt(state._replace(kv_share=1.0), 2000, 100)
    assert true > 1.2 * whole
    assert p.tbt_s == pytest.approx(true)
    assert p.decode_kv_share == share  # recorded, for the learned TBT's calibration rows
    rec = RequestRecord("later", clock.t)
    assert isinstance(RequestLifecycle(sched, rec, clock).decide(_facts("later")), Placement)
    assert rec.decode_kv_share == sched.ledger.decode_state("d", clock.t).kv_share < 0.4
    r = sched.ledger.get("new")
    assert r.decode_end_s - r.decode_start_s == pytest.approx(100 * whole)
