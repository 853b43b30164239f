"""``defer_share`` (scheduler/deferral.py ``_shared_sizes``): the room's cheapest-first order with the
uncached prefix several waiters share costed once for all of them. One prefill of a shared prefix
makes every other waiter holding it cheap, so a group is worth serving that each member alone is not."""
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
    assert DeferParams().share is False
    assert split_params({"defer_share": "on"})[0].share is True
    with pytest.raises(ValueError, match="defer_share"):
        split_params({"defer_share": "maybe"})


def _world(share: bool):
    clock = Clock(0.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], slo=SLO(ttft_s=10.0),
                      block_size=BS, clock=clock, **plain_room(defer_horizon_s=0.2, defer_share=share))
    return sched, clock, WaitRoom(sched)


def _wait(sched, clock, room, rid: str, tokens: list[int]) -> RequestLifecycle:
    lc = RequestLifecycle(sched, RequestRecord(rid, clock.t), clock)
    assert room.offer(lc, RequestFacts(rid, len(tokens), block_hashes(tokens, BS), 8)) is None
    assert lc.phase is Phase.WAITING
    return lc


def _room_with_a_pair(share: bool):
    """p0 busy past the horizon; waiting: a 3000-token prompt alone, and two 4000-token prompts
    whose first 3840 tokens are the same (each alone dearer than the lone one, together cheaper)."""
    sched, clock, room = _world(share)
    busy = RequestLifecycle(sched, RequestRecord("busy", 0.0), clock)
    assert isinstance(room.offer(busy, RequestFacts("busy", 16000, block_hashes(toks(1, 16000), BS), 8)), Placement)
    _wait(sched, clock, room, "alone", toks(2, 3000))
    for k, rid in enumerate(("pair_a", "pair_b")):
        _wait(sched, clock, room, rid, toks(3, 3840) + toks(10 + k, 160))
    return sched, clock, room


@pytest.mark.parametrize("share, first", [(False, "alone"), (True, "pair_a")])
def test_a_shared_prefix_is_costed_once_for_the_waiters_holding_it(share, first):
    sched, clock, room = _room_with_a_pair(share)
    clock.t = 0.5
    sched.prefill_done("busy")
    out = room.pump()
    assert out and out[0][0].request_id == first
    if share:  # the other member now hits the first's prefix in flight: it follows at once
        assert [lc.request_id for lc, _ in out][:2] == ["pair_a", "pair_b"]


def test_a_member_gone_leaves_the_other_costed_alone():
    sched, clock, room = _room_with_a_pair(True)
    assert room.cancel("pair_b") is not None
    clock.t = 0.5
    sched.prefill_done("busy")
    assert room.pump()[0][0].request_id == "alone"


def test_the_counts_empty_as_waiters_leave_every_way():
    sched, clock, room = _room_with_a_pair(True)
    room.cancel("alone")
    lc = room._waiting["pair_b"].lc
    lc.finish("aborted")  # finished by its driver without telling the room: the next pump drops it
    clock.t = 0.5
    sched.prefill_done("busy")
    out = room.pump()
    assert [x.request_id for x, _ in out] == ["pair_a"] and len(room) == 0
    assert not room._blocks  # no count outlives its waiter
