"""``defer_reeval_s`` (scheduler/deferral.py): a pump evaluates a waiting request again only once
that many seconds passed since its last evaluation. Live, each evaluation holds the gateway's event
loop for about a millisecond; 0 (the default) evaluates every waiter at every pump, as before."""
from __future__ import annotations

import pytest

from scheduler.deferral import DEADLINE, DeferParams, split_params
from scheduler.lifecycle import Phase
from tests.test_deferral import offer as offer_n, world as world_1p
from tests.test_deferral_holder import offer, turn, world


def test_params():
    assert split_params({"defer_reeval_s": "0.25"})[0].reeval_s == 0.25
    assert DeferParams().reeval_s == 0.0
    with pytest.raises(ValueError, match="defer_reeval_s"):
        split_params({"defer_reeval_s": "-1"})


@pytest.mark.parametrize("reeval, evaluated", [(0.0, [1, 1, 1]), (0.5, [0, 1, 0])])
def test_a_pump_skips_a_waiter_evaluated_less_than_reeval_s_ago(reeval, evaluated):
    # the turn waits for its busy holder p0 while p1 is idle: every pump passes the room's
    # shortest-queue gate and, without reeval_s, evaluates it again to keep it waiting
    sched, clock, room = world(defer_reeval_s=reeval)
    lc, d = offer(sched, clock, room, turn())
    assert d is None and lc.phase is Phase.WAITING
    w = room._waiting["w"]
    got = []
    for t in (0.1, 0.6, 0.7):
        clock.t = t
        before = w.evaluations
        assert room.pump() == []  # still waiting for p0 either way
        got.append(w.evaluations - before)
    assert got == evaluated


def test_a_skipped_waiter_still_expires_at_its_deadline():
    sched, clock, room = world_1p(ttft=1.0)
    sched.defer = room.params = DeferParams(True, 0.2, reeval_s=10.0)
    offer_n(sched, clock, room, "r0", 16000, 1)  # a long prefill holds the only queue
    lc, d = offer_n(sched, clock, room, "w", 500, 2)
    assert d is None
    clock.t = 0.99
    [(gone, refusal)] = room.pump()
    assert gone is lc and refusal.reason == DEADLINE and lc.phase is Phase.REJECTED
