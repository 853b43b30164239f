"""The wait room's wait-for-holder rule (``defer_wait_holder``, scheduler/deferral.py): a request the
policy would send off the instance holding its prefix, because that one's queue is over the horizon,
waits for it while it still meets its remaining TTFT SLO there and recomputing elsewhere costs more
than ``defer_holder_ratio`` x the holder's prefill; otherwise the policy's choice stands."""
from __future__ import annotations

import pytest

from predictors.telemetry import SLO, RequestRecord
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.deferral import DeferParams, WaitRoom, split_params
from scheduler.hashing import block_hashes
from scheduler.lifecycle import Phase, RequestLifecycle
from tests.room_stream import drive, hold as _hold
from tests.sched_helpers import Clock, plain_room, toks

BS = 16
DOC = toks(7, 12000)  # the conversation p0 holds


def hold(sched, inst, tokens):
    _hold(sched, inst, tokens, BS)


def world(wait_holder: bool = True, ttft: float = 2.0, **kw):
    """p0 holds DOC behind ~0.94 s of queued prefills (three, the head stuck past its prediction
    once the clock passes it); p1 is idle. Work weight 0: greedy TTFT sends a later turn to p1."""
    clock = Clock(0.0)
    insts = [Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode")]
    sched = Scheduler(insts, policy="conductor", slo=SLO(ttft_s=ttft), block_size=BS, clock=clock, peer_pull=False,
                      work_weight=0.0, **plain_room(defer_horizon_s=0.2, defer_wait_holder=wait_holder, **kw))
    hold(sched, "p0", DOC)
    for k in range(3):
        busy = toks(1 + k, 10000)
        hold(sched, "p0", busy[:2000])
        d = sched.decide(RequestFacts(f"busy{k}", 10000, block_hashes(busy, BS), 8, SLO(ttft_s=10.0)),
                         avoid={"p1"})
        assert isinstance(d, Placement) and d.prefill == "p0"
    return sched, clock, WaitRoom(sched)


def turn(rid: str = "w") -> RequestFacts:
    """A later turn of DOC's conversation: cheap on p0 only."""
    return RequestFacts(rid, 12100, block_hashes(DOC + toks(3, 100), BS), 8)


def offer(sched, clock, room, f):
    lc = RequestLifecycle(sched, RequestRecord(f.request_id, clock.t), clock)
    return lc, room.offer(lc, f)


def test_params():
    p, rest = split_params({"defer": "on", "defer_wait_holder": "on", "defer_holder_ratio": "2", "work_weight": 4,
                            "defer_holder_fallback": "on"})
    assert p.wait_holder and p.holder_ratio == 2.0 and p.holder_fallback and rest == {"work_weight": 4}
    assert not DeferParams().wait_holder and not DeferParams().holder_fallback
    with pytest.raises(ValueError, match="defer_holder_ratio"):
        split_params({"defer_holder_ratio": "0.5"})


def test_without_the_rule_the_policy_recomputes_on_the_idle_instance():
    sched, clock, room = world(wait_holder=False)
    _, d = offer(sched, clock, room, turn())
    assert isinstance(d, Placement) and d.prefill == "p1" and d.hit_tokens == 0


def test_a_request_sent_off_its_busy_holder_waits_for_it_then_goes_there():
    sched, clock, room = world()
    lc, d = offer(sched, clock, room, turn())
    assert d is None and lc.phase is Phase.WAITING
    assert sched.ledger.instance_totals("p1")["active_requests"] == 0
    clock.t = 0.05
    assert room.pump() == [] and lc.phase is Phase.WAITING  # p0 still over the horizon: keeps waiting
    for k in range(3):  # p0's queue drains
        assert sched.prefill_done(f"busy{k}")
    clock.t = 0.3
    [(x, d)] = room.pump()
    assert x is lc and isinstance(d, Placement) and d.prefill == "p0" and d.hit_tokens == 12000
    note = d.explanation["deferred"]
    assert note["waited_for_holder"] == "p0" and note["waited_s"] == pytest.approx(0.3)


def test_no_wait_when_the_holder_would_miss_the_slo_or_recomputing_is_cheap_enough():
    # 0.9 s: p0 (0.94 s of queue + its cached prefill) misses it, p1 (~0.52 s) meets it
    sched, clock, room = world(ttft=0.9)
    _, d = offer(sched, clock, room, turn())
    assert isinstance(d, Placement) and d.prefill == "p1"
    # p1's full prefill (~0.47 s) is < 100 x p0's cached one (~0.007 s): the policy's choice stands
    sched, clock, room = world(defer_holder_ratio=100.0)
    _, d = offer(sched, clock, room, turn())
    assert isinstance(d, Placement) and d.prefill == "p1"


def test_a_holder_that_stops_fitting_the_remaining_slo_releases_the_waiter():
    sched, clock, room = world(ttft=1.5)
    lc, d = offer(sched, clock, room, turn())
    assert d is None and lc.phase is Phase.WAITING  # p0 ~0.99 s <= 1.5 s
    clock.t = 0.9  # p0's stuck head keeps ~0.63 s of queue: ~0.67 s > the 0.6 s left; p1 (~0.52 s) fits
    [(x, d)] = room.pump()
    assert x is lc and isinstance(d, Placement) and d.prefill == "p1"
    assert d.explanation["deferred"]["waited_for_holder"] == "p0"


def test_fallback_waits_only_while_the_policys_choice_would_still_be_in_time():
    # 1.2 s: p0 (~0.99 s) meets it, so the request waits; but p1 (~0.52 s) after p0's ~0.74 s of queue
    # over the horizon would not: with the fallback it goes to p1 now
    sched, clock, room = world(ttft=1.2)
    lc, d = offer(sched, clock, room, turn())
    assert d is None and lc.phase is Phase.WAITING
    sched, clock, room = world(ttft=1.2, defer_holder_fallback=True)
    _, d = offer(sched, clock, room, turn())
    assert isinstance(d, Placement) and d.prefill == "p1"
    sched, clock, room = world(ttft=1.5, defer_holder_fallback=True)  # ~1.26 s: still in time, it waits
    lc, d = offer(sched, clock, room, turn())
    assert d is None and lc.phase is Phase.WAITING


def _stream(wait_holder: bool | None) -> tuple[list[str], int]:
    """Decisions of a conversation-like stream through a wait room with defer on (None: the rule's
    parameter not given at all)."""
    clock = Clock(0.0)
    kw = {} if wait_holder is None else {"defer_wait_holder": wait_holder}
    sched = Scheduler([Instance(f"p{k}", "prefill") for k in range(3)] + [Instance("d0", "decode")],
                      policy="conductor", slo=SLO(ttft_s=3.0), block_size=BS, clock=clock,
                      peer_pull=False, work_weight=0.0, **plain_room(defer_horizon_s=0.2, **kw))
    docs = [toks(100 + c, 6000) for c in range(6)]
    return drive(sched, clock, lambda k: docs[0 if k % 2 else k // 2 % 6] + toks(k, 1000 + 500 * (k % 5)),  # doc 0 hot
                 "waited_for_holder", BS)


def test_off_decides_byte_identically(monkeypatch):
    on, held = _stream(True)
    assert held > 0  # the stream does send requests off busy holders
    import scheduler.deferral_waiter as deferral_waiter
    monkeypatch.setattr(deferral_waiter, "_wait_for_holder", lambda *a: pytest.fail("wait_holder ran while off"))
    off, none = _stream(False)
    assert none == 0 and off != on
    assert off == _stream(None)[0]  # off is the default
