"""``defer_size`` (scheduler/deferral_waiter.py ``_sized``): the room's cheapest-first order by a
request's share of both pools, prefill seconds over the prefill instances plus its decode
KV-seconds over the decode instances' KV, instead of its prefill alone. A decode-bound cluster is
spent by KV held while decoding, which the prompt's prefill cost does not see."""
from __future__ import annotations

import pytest

from predictors.telemetry import SLO, RequestRecord
from scheduler import Instance, Placement, Scheduler
from scheduler.deferral import DeferParams, WaitRoom, split_params
from scheduler.lifecycle import Phase, RequestLifecycle
from tests.sched_helpers import Clock, plain_room
from tests.test_deferral import facts, offer


def test_params():
    assert DeferParams().size == "prefill"
    assert split_params({"defer_size": "pools"})[0].size == "pools"
    for bad in ("decode", "", 1):
        with pytest.raises(ValueError, match="defer_size"):
            split_params({"defer_size": bad})


def test_pool_scale_counts_the_healthy_instances():
    insts = [Instance("p0", "prefill"), Instance("p1", "prefill"),
             Instance("d0", "decode", kv_capacity_tokens=1000), Instance("d1", "decode", kv_capacity_tokens=3000)]
    sched = Scheduler(insts, clock=Clock(0.0))
    assert sched.pool_scale() == (2, 4000)
    sched.set_healthy("d1", False)
    sched.set_healthy("p0", False)
    assert sched.pool_scale() == (1, 1000)


def _room(size: str):
    clock = Clock(0.0)
    insts = [Instance("p0", "prefill"), Instance("d0", "decode")]
    sched = Scheduler(insts, slo=SLO(ttft_s=4.0), block_size=16, clock=clock,
                      **plain_room(defer_horizon_s=0.2, defer_size=size))
    return sched, clock, WaitRoom(sched)


@pytest.mark.parametrize("size, first", [("prefill", "long_answer"), ("pools", "long_prompt")])
def test_the_order_weighs_the_decode_kv_only_with_pools(size, first):
    sched, clock, room = _room(size)
    offer(sched, clock, room, "busy", 16000, 1)  # fills p0's queue past the horizon: the rest wait
    # a short prompt with a long answer (its KV held for 6000 decode steps) against a longer prompt
    # with an 8-token answer: cheaper to prefill, dearer to decode
    for rid, n, out, seed in (("long_answer", 1000, 6000, 2), ("long_prompt", 3000, 8, 3)):
        lc = RequestLifecycle(sched, RequestRecord(rid, clock.t), clock)
        assert room.offer(lc, facts(rid, n, seed, max_tokens=out)) is None and lc.phase is Phase.WAITING
    clock.t = 0.5
    sched.prefill_done("busy")
    out = room.pump()
    assert [lc.request_id for lc, _ in out][0] == first
    notes = {lc.request_id: d.explanation for lc, d in out if isinstance(d, Placement)}
    for rec in notes.values():
        note = rec["deferred"]
        if size == "prefill":
            assert note["size_s"] == note["cost_s"]
        else:  # the prefill over one prefill instance plus the decode KV-seconds over d0's KV
            n_prefill, kv = sched.pool_scale()
            out_tokens = rec["max_tokens"]
            held = (rec["prompt_tokens"] + out_tokens / 2) * out_tokens * rec["terms"]["tbt_s"]
            assert n_prefill == 1 and note["size_s"] > note["cost_s"]
            assert note["size_s"] == pytest.approx(note["cost_s"] + held / kv, rel=0.05)

