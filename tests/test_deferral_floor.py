"""The wait room's fairness floor (``defer_floor_every``) and slack aging (``defer_slack_aging``):
a long waiter that shortest-job-first would hold goes, and off decides byte-identically."""
from __future__ import annotations

import pytest

from predictors.telemetry import SLO, RequestRecord
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.deferral import DeferParams, WaitRoom, split_params
from scheduler.hashing import block_hashes
from scheduler.lifecycle import Phase, RequestLifecycle
from tests.room_stream import drive
from tests.sched_helpers import Clock, plain_room, toks

BS = 16


def world(ttft: float = 6.0, **kw):
    clock = Clock(0.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], policy="conductor",
                      slo=SLO(ttft_s=ttft), block_size=BS, clock=clock,
                      **plain_room(defer_horizon_s=0.2, defer_scan=64, **kw))
    return sched, clock, WaitRoom(sched)


def offer(sched, clock, room, rid: str, n: int, seed: int):
    lc = RequestLifecycle(sched, RequestRecord(rid, clock.t), clock)
    return lc, room.offer(lc, RequestFacts(rid, n, block_hashes(toks(seed, n), BS), 8))


def test_params():
    p, rest = split_params({"defer": "on", "defer_floor_every": "4", "defer_slack_aging": "on",
                            "defer_floor_quantile": "0.5", "x": 1})
    assert p.floor_every == 4 and p.slack_aging and p.floor_quantile == 0.5 and rest == {"x": 1}
    assert DeferParams().floor_every == 0 and not DeferParams().slack_aging  # off by default
    for bad in ({"defer_floor_every": "-1"}, {"defer_floor_every": "1.5"}, {"defer_floor_every": True},
                {"defer_slack_aging": "maybe"}, {"defer_floor_quantile": "1.5"}, {"defer_floor_quantile": "-0.1"}):
        with pytest.raises(ValueError, match="defer_"):
            split_params(bad)


def _drain(floor_every: int, quantile: float = 0.9) -> tuple[list[str], WaitRoom, RequestLifecycle]:
    """A long prompt waits behind a busy instance with six shorter ones; the head finishes: who goes."""
    kw = {"defer_floor_every": floor_every, "defer_floor_quantile": quantile} if floor_every else {}
    sched, clock, room = world(**kw)
    sched.decide(RequestFacts("r0", 16000, block_hashes(toks(1, 16000), BS), 8))
    lc, d = offer(sched, clock, room, "long", 16000, 2)
    assert d is None and lc.phase is Phase.WAITING
    for k in range(6):
        assert offer(sched, clock, room, f"s{k}", 2000 + 100 * k, 10 + k)[1] is None
    clock.t = 0.7
    sched.prefill_done("r0")
    return [x.request_id for x, d in room.pump() if isinstance(d, Placement)], room, lc


def test_shortest_first_holds_the_long_prompt_the_floor_dispatches_it():
    sjf, room, lc = _drain(0)
    assert sjf and "long" not in sjf and lc.phase is Phase.WAITING  # the short ones fill the horizon
    assert "floor" not in room.counts
    for k in (1, 2):
        order, room, lc = _drain(k)
        # every k-th dispatch is the floor's: the cheapest of the long prompts (here the longest seventh)
        assert order.index("long") == k - 1 and lc.phase is Phase.PLACED, (k, order)
        assert room.counts["floor"] == 1
        assert lc.record.extra["wait_s"] == pytest.approx(0.7)
    # the long class cut at the 75th percentile of the seven: 2500 and 16000 tokens; the cheaper goes
    order, room, lc = _drain(1, 0.75)
    assert order[:2] == ["s5", "long"]  # every dispatch the floor's: both long ones, cheaper first


def test_the_floor_skips_a_waiter_its_last_evaluation_refused():
    """Only a waiter that could still meet its SLO is the floor's: one refused for TTFT (it waits for
    drained queues) is not sent ahead of the cheap ones."""
    sched, clock, room = world(ttft=1.2, defer_floor_every=1)
    sched.decide(RequestFacts("r0", 16000, block_hashes(toks(1, 16000), BS), 8))
    lc, d = offer(sched, clock, room, "long", 16000, 2)  # 0.66 s behind 0.66 s: over 1.2 s, refused for now
    assert d is None
    w = room._waiting["long"]
    assert w.latest_s == float("inf")
    offer(sched, clock, room, "s0", 2000, 10)
    assert room._waiting["s0"].latest_s < float("inf")


def test_slack_aging_lets_an_old_long_waiter_pass_a_newer_cheaper_one():
    def first(**kw):
        sched, clock, room = world(ttft=3.0, **kw)
        for k in range(2):  # ~1.3 s of queue
            sched.decide(RequestFacts(f"r{k}", 16000, block_hashes(toks(1 + k, 16000), BS), 8))
        offer(sched, clock, room, "old", 4000, 5)
        clock.t = 0.9
        offer(sched, clock, room, "new", 3000, 6)
        assert len(room) == 2
        clock.t = 1.4  # old has 53% of its SLO left, new 83%: 0.53 x its cost is less than 0.83 x new's
        sched.prefill_done("r0")
        sched.prefill_done("r1")
        return room.pump()[0][0].request_id
    assert first() == "new" and first(defer_slack_aging=True) == "old"


def _stream(**kw) -> tuple[list[str], int]:
    """Decisions of an overloaded stream of short and long prompts through a wait room."""
    clock = Clock(0.0)
    sched = Scheduler([Instance(f"p{k}", "prefill") for k in range(2)] + [Instance("d0", "decode")],
                      policy="conductor", slo=SLO(ttft_s=3.0), block_size=BS, clock=clock,
                      **plain_room(defer_horizon_s=0.2, defer_aging=0.05, defer_scan=64, **kw))
    return drive(sched, clock, lambda k: toks(k, 12000 if k % 4 == 0 else 1500 + 300 * (k % 3)), "floor", BS,
                 steps=80, dt=0.08)


def test_off_decides_byte_identically():
    on, floored = _stream(defer_floor_every=2)
    assert floored > 0  # the stream does give the floor turns
    off, none = _stream(defer_floor_every=0)
    assert none == 0 and off != on
    assert off == _stream()[0]  # off is the default
    slack, _ = _stream(defer_slack_aging=True)
    assert slack != off and _stream(defer_slack_aging=False)[0] == off
