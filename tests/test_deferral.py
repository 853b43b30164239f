"""The wait room (scheduler/deferral.py) against a real Scheduler and a settable clock: who waits,
who goes first, deadlines, cancellation, the remaining SLO, and byte-identical decisions when off."""
from __future__ import annotations

import json

import pytest

from predictors.telemetry import SLO, RequestRecord
from scheduler import Instance, Placement, Rejection, RequestFacts, Scheduler
from scheduler.deferral import DEADLINE, DeferParams, WaitRoom, split_params
from scheduler.hashing import block_hashes
from scheduler.lifecycle import LifecycleError, Phase, RequestLifecycle
from tests.sched_helpers import Clock, plain_room, toks

BS = 16


def world(defer: bool = True, horizon: float = 0.2, ttft: float | None = 2.0, aging: float = 0.0,
          policy: str = "conductor", prefill: int = 1, slack: float | None = None):
    clock = Clock(0.0)
    insts = [Instance(f"p{k}", "prefill") for k in range(prefill)] + [Instance("d0", "decode")]
    sched = Scheduler(insts, policy=policy, slo=SLO(ttft_s=ttft), block_size=BS, clock=clock,
                      **plain_room(defer=defer, defer_horizon_s=horizon, defer_aging=aging,
                                   defer_last_chance=slack is not None, defer_slack=slack or 0.0))
    return sched, clock, WaitRoom(sched)


def facts(rid: str, n: int, seed: int, max_tokens: int = 8) -> RequestFacts:
    return RequestFacts(rid, n, block_hashes(toks(seed, n), BS), max_tokens)


def offer(sched, clock, room, rid, n, seed=None):
    lc = RequestLifecycle(sched, RequestRecord(rid, clock.t), clock)
    return lc, room.offer(lc, facts(rid, n, seed if seed is not None else hash(rid) % 1000))


def test_params_parse_and_validate():
    p, rest = split_params({"defer": "on", "defer_horizon_s": "0.5", "defer_aging": 0.1, "work_weight": 2,
                            "defer_slack": "0.2"})
    assert p == DeferParams(True, 0.5, 0.1, slack=0.2) and rest == {"work_weight": 2}
    assert split_params({"defer_last_chance": "on"})[0].last_chance
    assert split_params({})[0] == DeferParams() and not DeferParams().enabled
    for bad in ({"defer": "maybe"}, {"defer_horizon_s": "-1"}, {"defer_scan": "0"}, {"defer_aging": "x"},
                {"defer_slack": "-0.1"}):
        with pytest.raises(ValueError, match="defer"):
            split_params(bad)
    assert Scheduler([Instance("b", "both")], policy="round_robin", defer="on").defer.enabled


def test_short_queue_dispatches_now_and_long_queue_waits():
    sched, clock, room = world()
    lc0, d0 = offer(sched, clock, room, "long0", 16000)
    assert isinstance(d0, Placement) and lc0.phase is Phase.PLACED and d0.queue_s == 0.0
    lc1, d1 = offer(sched, clock, room, "short", 500)
    assert d1 is None and lc1.phase is Phase.WAITING and "short" in room
    assert "short" not in sched.ledger  # a waiting request holds no reservation
    assert len(sched.ledger) == 1


def test_waiting_requests_dispatch_cheapest_first_with_the_remaining_slo():
    sched, clock, room = world()
    offer(sched, clock, room, "r0", 16000, 1)
    sizes = {"a": 2000, "b": 16000, "c": 500, "d": 1000}
    lcs = {rid: offer(sched, clock, room, rid, n, k + 2)[0] for k, (rid, n) in enumerate(sizes.items())}
    assert all(lc.phase is Phase.WAITING for lc in lcs.values())
    assert room.pump() == []  # the only queue is still longer than the horizon: nobody goes
    clock.t = 0.5
    sched.prefill_done("r0")
    out = room.pump()
    order = [lc.request_id for lc, _ in out]
    assert order[:3] == ["c", "d", "a"]  # cheapest predicted prefill first
    for lc, d in out:
        assert isinstance(d, Placement) and lc.phase is Phase.PLACED
        note = d.explanation["deferred"]
        assert note["waited_s"] == pytest.approx(0.5) and note["arrived_s"] == 0.0
        # the TTFT SLO runs from arrival: the decision was admitted against what was left of it
        assert d.explanation["slo"]["ttft_s"] == pytest.approx(1.5)
        assert lc.record.extra["wait_s"] == pytest.approx(0.5) and lc.record.decided_s == 0.5
        assert d.ttft_s <= 1.5


def test_last_chance_dispatches_behind_a_long_queue_before_the_slo_is_lost():
    """Shortest-job-first alone would keep a long prompt waiting while the queue stays long; at
    its last chance (its TTFT behind the queue leaves only the slack) it goes anyway."""
    sched, clock, room = world(ttft=6.0, slack=0.1)  # 0.6 s of slack
    for k in range(4):  # ~2.6 s of queue that never drains (no prefill finishes)
        sched.decide(facts(f"r{k}", 16000, k + 1))
    lc, d = offer(sched, clock, room, "long", 16000, 9)
    assert d is None
    out: list = []
    while not out:
        wake = room.next_wakeup()
        assert wake is not None and clock.t < wake < 6.0
        clock.t = wake
        out = room.pump()
    [(x, d)] = out
    assert x is lc and isinstance(d, Placement) and d.queue_s > 0.2 and d.explanation["deferred"]["last_chance"]
    assert 0.6 - 1e-6 <= (6.0 - clock.t) - d.ttft_s  # it meets what is left of its SLO, the slack in hand


def test_deadline_refuses_and_holds_nothing():
    sched, clock, room = world()
    offer(sched, clock, room, "r0", 16000, 1)
    lc, d = offer(sched, clock, room, "big", 16000, 2)
    assert d is None
    wake = room.next_wakeup()
    assert wake is not None and 0.0 < wake < 2.0
    clock.t = 1.9  # the remaining 0.1 s cannot hold a 0.66 s prefill, queue or not
    out = room.pump()
    assert [(x.request_id, r.reason) for x, r in out] == [("big", DEADLINE)]
    rej = out[0][1]
    assert isinstance(rej, Rejection) and rej.status == 429 and rej.retry_after_s >= 1
    assert lc.phase is Phase.REJECTED and lc.record.status == "rejected"
    assert lc.record.reject_reason == DEADLINE and lc.record.extra["wait_s"] == pytest.approx(1.9)
    assert rej.explanation["deferred"]["waited_s"] == pytest.approx(1.9)
    assert "big" not in sched.ledger and "big" not in room and len(room) == 0
    assert sched.counts[DEADLINE] == 1 and sched.decisions[-1]["reason"] == DEADLINE
    assert room.next_wakeup() is None
    sched.release("r0")
    assert sched.ledger.is_idle()


def test_a_pump_late_past_the_whole_slo_refuses_deadline_not_an_error():
    """A pump that reaches a waiter after its TTFT SLO has run out (a starved event loop) refuses
    it as ``deadline`` (429) rather than evaluating a negative SLO (a 400 to the client)."""
    sched, clock, room = world()
    offer(sched, clock, room, "r0", 16000, 1)
    lc, d = offer(sched, clock, room, "big", 16000, 2)
    assert d is None
    clock.t = 2.5  # past the 2 s SLO with no pump in between
    out = room.pump()
    assert [(x.request_id, r.reason) for x, r in out] == [("big", DEADLINE)]
    assert out[0][1].status == 429 and lc.phase is Phase.REJECTED
    assert "big" not in sched.ledger and len(room) == 0


def test_unreachable_and_bad_requests_are_refused_at_once():
    sched, clock, room = world()
    offer(sched, clock, room, "r0", 16000, 1)
    lc, d = offer(sched, clock, room, "huge", 60000, 2)  # ~3 s of prefill against a 2 s SLO
    assert isinstance(d, Rejection) and d.reason == "ttft_slo_unreachable" and lc.phase is Phase.REJECTED
    lc2 = RequestLifecycle(sched, RequestRecord("bad", 0.0), clock)
    d2 = room.offer(lc2, RequestFacts("bad", 0, [], 8))
    assert isinstance(d2, Rejection) and d2.status == 400 and lc2.phase is Phase.REJECTED
    assert len(room) == 0


def test_cancel_removes_a_waiting_request():
    sched, clock, room = world()
    offer(sched, clock, room, "r0", 16000, 1)
    lc, _ = offer(sched, clock, room, "gone", 500, 2)
    lc2, _ = offer(sched, clock, room, "also_gone", 700, 3)
    assert room.cancel("gone") is lc and room.cancel("gone") is None and "gone" not in room
    clock.t = 0.3
    assert lc.finish("aborted") and lc.record.extra["wait_s"] == pytest.approx(0.3)
    lc2.finish("aborted")  # finished by its driver without telling the room: the next pump drops it
    sched.prefill_done("r0")
    assert room.pump() == [] and len(room) == 0 and room.counts["cancelled"] == 2
    sched.release("r0")
    assert sched.ledger.is_idle()


def test_pump_evaluates_nobody_while_every_queue_is_long():
    sched, clock, room = world(prefill=2)
    offer(sched, clock, room, "r0", 16000, 1)
    offer(sched, clock, room, "r1", 16000, 2)
    for k in range(5):
        assert offer(sched, clock, room, f"w{k}", 1000 + 100 * k, 10 + k)[1] is None
    calls = []
    real = sched.evaluate
    sched.evaluate = lambda f, *a, **k: calls.append(f.request_id) or real(f, *a, **k)  # type: ignore[method-assign]
    clock.t = 0.1
    assert room.pump() == [] and calls == []
    clock.t = 0.3  # p1's head has 0.36 s left: still over the horizon
    sched.prefill_done("r0")
    out = room.pump()
    assert out and calls  # now one instance has room: the cheapest go there
    assert {d.prefill for _, d in out if isinstance(d, Placement)} == {"p0"}


def test_aging_lets_an_old_request_pass_a_cheaper_new_one():
    def first(aging):
        sched, clock, room = world(aging=aging, ttft=10.0)
        offer(sched, clock, room, "r0", 16000, 1)
        offer(sched, clock, room, "old", 4000, 2)
        clock.t = 0.4
        offer(sched, clock, room, "new", 3000, 3)
        clock.t = 0.6
        sched.prefill_done("r0")
        return room.pump()[0][0].request_id
    assert first(0.0) == "new" and first(1.0) == "old"


def test_lifecycle_transitions_stay_checked():
    sched, clock, room = world()
    lc = RequestLifecycle(sched, RequestRecord("x", 0.0), clock)
    with pytest.raises(LifecycleError):
        lc.refuse(Rejection("x", 429, DEADLINE, "m"))
    lc.wait()
    with pytest.raises(LifecycleError):
        lc.wait()
    with pytest.raises(LifecycleError):
        lc.prefill_started()
    with pytest.raises(LifecycleError):
        lc.retry()
    assert lc.waited_s == 0.0


def _stream(defer: bool | None) -> list[str]:
    """Decisions of a stream through a wait room with ``defer`` off (None: plain ``decide``)."""
    clock = Clock(0.0)
    params = {} if defer is None else {"defer": defer}
    sched = Scheduler([Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode")],
                      policy="conductor", slo=SLO(ttft_s=1.0), block_size=BS, clock=clock, **params)
    room = WaitRoom(sched)
    out = []
    for k in range(60):
        clock.t = 0.13 * k
        f = facts(f"r{k}", 300 + (k * 977) % 12000, k % 9)
        lc = RequestLifecycle(sched, RequestRecord(f.request_id, clock.t), clock)
        d = lc.decide(f) if defer is None else room.offer(lc, f)
        assert d is not None and len(room) == 0
        out.append(json.dumps([type(d).__name__, d.explanation], sort_keys=True, default=repr))
        if k % 3 == 0 and isinstance(d, Placement):
            sched.prefill_done(d.request_id)
        assert room.pump() == []
    return out


def test_off_decides_byte_identically():
    plain, off = _stream(None), _stream(False)
    assert plain == off and any('"Rejection"' in x for x in plain) and any('"Placement"' in x for x in plain)
