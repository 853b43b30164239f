"""``defer_join`` (scheduler/deferral.py): an arrival the policy would dispatch at once joins the room
while others wait there, and the room is pumped at once, so it goes now only if no cheaper waiter
takes the queue first. Without it an arrival overtakes every waiter whenever it finds a queue within
the horizon, and the room's cheapest-first order holds only between pumps."""
from __future__ import annotations

import pytest

from predictors.telemetry import SLO, RequestRecord
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.deferral import DeferParams, WaitRoom, split_params
from scheduler.hashing import block_hashes
from scheduler.lifecycle import Phase, RequestLifecycle
from tests.sched_helpers import Clock, plain_room, toks

BS = 16


def test_params():
    assert DeferParams().join is False
    assert split_params({"defer_join": "on"})[0].join is True
    with pytest.raises(ValueError, match="defer_join"):
        split_params({"defer_join": "maybe"})


def _world(join: bool, **extra):
    clock = Clock(0.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], slo=SLO(ttft_s=10.0),
                      block_size=BS, clock=clock, **plain_room(defer_horizon_s=0.01, defer_join=join, **extra))
    return sched, clock, WaitRoom(sched)


def _offer(sched, clock, room, rid: str, tokens: int, seed: int):
    lc = RequestLifecycle(sched, RequestRecord(rid, clock.t), clock)
    return lc, room.offer(lc, RequestFacts(rid, tokens, block_hashes(toks(seed, tokens), BS), 8))


def _drained_with_a_waiter(join: bool, **extra):
    """p0 busy past the horizon while a 2000-token prompt arrives and waits; then p0's queue
    drains, and before any pump a 6000-token prompt arrives."""
    sched, clock, room = _world(join, **extra)
    assert isinstance(_offer(sched, clock, room, "busy", 16000, 1)[1], Placement)
    small, d = _offer(sched, clock, room, "small", 2000, 2)
    assert d is None and small.phase is Phase.WAITING
    clock.t = 0.5
    sched.prefill_done("busy")
    big, d = _offer(sched, clock, room, "big", 6000, 3)
    return sched, clock, room, big, d


def test_without_join_an_arrival_overtakes_the_cheaper_waiter():
    sched, clock, room, big, d = _drained_with_a_waiter(False)
    assert isinstance(d, Placement) and d.prefill == "p0"
    assert [lc.request_id for lc, _ in room.pump()] == []  # p0 is busy again: small waits on
    assert "small" in room


@pytest.mark.parametrize("extra", [{}, {"defer_reeval_s": 5.0}])
def test_with_join_the_arrival_waits_its_turn_and_the_room_pumps_at_once(extra):
    sched, clock, room, big, d = _drained_with_a_waiter(True, **extra)
    assert d is None and big.phase is Phase.WAITING and room.counts["joined"] == 1
    assert room.next_wakeup() == clock.t  # now: the pump decides whose turn it is
    out = room.pump()
    assert [lc.request_id for lc, _ in out] == ["small"] and isinstance(out[0][1], Placement)
    assert "big" in room and room.next_wakeup() > clock.t  # p0 busy again; big waits for it


def test_with_join_an_arrival_at_an_empty_room_goes_at_once():
    sched, clock, room = _world(True)
    lc, d = _offer(sched, clock, room, "first", 2000, 4)
    assert isinstance(d, Placement) and room.counts["joined"] == 0 and len(room) == 0


def test_a_joiner_cheapest_of_all_is_dispatched_by_that_pump():
    sched, clock, room = _world(True, defer_reeval_s=5.0)
    assert isinstance(_offer(sched, clock, room, "busy", 16000, 1)[1], Placement)
    assert _offer(sched, clock, room, "big", 6000, 2)[1] is None
    clock.t = 0.5
    sched.prefill_done("busy")
    assert _offer(sched, clock, room, "small", 2000, 3)[1] is None  # joins (big waits), though p0 has room
    out = room.pump()  # evaluated again at once, reeval_s notwithstanding: the cheapest goes
    assert [lc.request_id for lc, _ in out] == ["small"]
