"""``defer_eval_every_s`` (scheduler/deferral.py): the pumps' evaluations are paid from a bucket
refilled one per that many seconds of the scheduler's clock, holding at most ``defer_scan``. Live,
each evaluation holds the gateway's event loop for about a millisecond, and a live gateway pumps far
more often than the simulator (every arrival, every request's end, a timer): the budget makes both
spend the same evaluations per second of their clock."""
from __future__ import annotations

import pytest

from scheduler.deferral import DEADLINE, DeferParams, split_params
from scheduler.lifecycle import Phase
from tests.test_deferral_holder import offer, turn, world


def test_params():
    assert split_params({"defer_eval_every_s": "0.004"})[0].eval_every_s == 0.004
    assert DeferParams().eval_every_s == 0.0
    for bad in ("-1", "nan", "x"):
        with pytest.raises(ValueError, match="defer_eval_every_s"):
            split_params({"defer_eval_every_s": bad})


def _waiting_room(every: float, ttft: float = 10.0):
    # six turns wait for their busy holder p0 while p1 is idle: every pump passes the room's
    # shortest-queue gate and evaluates them again (up to defer_scan=4 in a row) to keep them waiting
    sched, clock, room = world(ttft=ttft, defer_scan=4, defer_eval_every_s=every)
    for k in range(6):
        lc, d = offer(sched, clock, room, turn(f"w{k}"))
        assert d is None and lc.phase is Phase.WAITING
    return clock, room


@pytest.mark.parametrize("every, expected", [(0.0, [4, 4, 4, 4]), (0.1, [4, 0, 2, 4])])
def test_a_pump_evaluates_no_more_than_the_budget_refilled(every, expected):
    clock, room = _waiting_room(every)
    offered = room.counts["evaluations"]
    assert offered == 6  # each offer's own evaluation is not paid from the budget
    got = []
    for t in (0.10, 0.15, 0.35, 1.0):  # full at first; 0.05 s later half an evaluation; then 2.5; then full again
        clock.t = t
        before = room.counts["evaluations"]
        assert room.pump() == []  # all still waiting for p0
        got.append(room.counts["evaluations"] - before)
    assert got == expected and len(room) == 6


def test_an_empty_budget_never_holds_a_waiter_past_its_deadline():
    clock, room = _waiting_room(every=100.0, ttft=0.5)
    clock.t = 0.05
    room.pump()  # spends the budget
    clock.t = 0.6  # every deadline passed, no evaluation paid for
    out = room.pump()
    assert len(out) == 6 and {d.reason for _, d in out} == {DEADLINE} and len(room) == 0
    assert all(lc.phase is Phase.REJECTED for lc, _ in out)
