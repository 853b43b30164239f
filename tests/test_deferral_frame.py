"""The wait room's frames (scheduler/frame.py): evaluations in a row share one instant's load views
and each waiter's hit-index answer, and anything decided, or any index change, makes the next
evaluation read the world again. Counted through wrappers, never timed."""
from __future__ import annotations

import json

from predictors.telemetry import SLO, RequestRecord
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.deferral import WaitRoom
from scheduler.explain import candidates, cheapest_prefill_s
from scheduler.frame import LoadFrame
from scheduler.hashing import block_hashes
from scheduler.hit_index import HitIndex
from scheduler.lifecycle import Phase, RequestLifecycle
from tests.sched_helpers import Clock, plain_room, toks
from tests.test_deferral import BS, facts, offer, world


def count(obj, name):
    """Wrap ``obj.name`` to count its calls; returns the list the calls are appended to."""
    calls: list[tuple] = []
    real = getattr(obj, name)

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)

    setattr(obj, name, counted)
    return calls


def held_room(waiters=5):
    """p0 holds the waiters' common 4000-token prefix and is busy (a 6000-token prefill over the
    horizon); p1 is empty but would recompute the prefix (no peer pull), so every waiter chooses
    p0 and waits, while p1's empty queue keeps the pump evaluating them."""
    clock = Clock(0.0)
    sched = Scheduler([Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode")],
                      slo=SLO(ttft_s=5.0), block_size=BS, clock=clock, peer_pull=False,
                      **plain_room(defer_horizon_s=0.05, defer_scan=64))
    room = WaitRoom(sched)
    prefix = toks(7, 4000)
    assert sched.index.block_stored("p0", block_hashes(prefix, BS), None, prefix, BS, "GPU")
    busy = RequestLifecycle(sched, RequestRecord("busy", 0.0), clock)
    d = busy.decide(RequestFacts("busy", 6000, block_hashes(toks(1, 6000), BS), 8), avoid=("p1",))
    assert isinstance(d, Placement) and d.prefill == "p0" and d.queue_s == 0.0
    texts = {}
    for k in range(waiters):
        texts[f"w{k}"] = text = prefix + toks(20 + k, 100 + 10 * k)
        lc = RequestLifecycle(sched, RequestRecord(f"w{k}", 0.0), clock)
        assert room.offer(lc, RequestFacts(f"w{k}", len(text), block_hashes(text, BS), 8)) is None
    return sched, clock, room, texts


def test_one_pump_reads_the_ledger_once_for_all_the_evaluations_that_dispatch_nobody():
    sched, clock, room, _ = held_room(5)
    clock.t = 0.01
    views, evals = count(sched.ledger, "prefill_views"), count(sched, "evaluate")
    assert room.pump() == []
    assert len(evals) == 5  # each waiter evaluated again (scan 64): each still chooses the busy holder
    assert len(views) == 1  # one read of every queue at the pump's instant, shared by the five
    assert all(w.evaluations == 2 and w.instance == "p0" for w in room._waiting.values())


def test_a_waiter_whose_instance_drains_is_reconsidered_on_the_next_pump():
    sched, clock, room, _ = held_room(2)
    clock.t = 0.01
    assert room.pump() == []
    clock.t = 0.02
    sched.prefill_done("busy")  # p0's queue is empty now
    out = room.pump()
    assert [(lc.request_id, d.prefill) for lc, d in out] == [("w0", "p0"), ("w1", "p0")]


def test_frame_is_thrown_away_after_a_dispatch_so_the_next_waiter_sees_the_reserved_queue():
    # two waiters whose best instance is the same empty p0: the first goes there; the second must
    # see p0's queue with the first in it (over the horizon) and wait, as without frames
    sched, clock, room = world(prefill=1, horizon=0.05)
    offer(sched, clock, room, "r0", 16000, 1)
    a = offer(sched, clock, room, "a", 3000, 2)[0]
    b = offer(sched, clock, room, "b", 3000, 3)[0]
    assert a.phase is b.phase is Phase.WAITING
    clock.t = 0.5
    sched.prefill_done("r0")
    views = count(sched.ledger, "prefill_views")
    out = room.pump()
    assert [lc.request_id for lc, _ in out] == ["a"] and isinstance(out[0][1], Placement)
    assert b.phase is Phase.WAITING  # a frame kept past the dispatch would have sent it to p0 too
    assert len(views) >= 2  # read again after the dispatch
    assert room._frame is None  # nothing carries over to the next pump


def test_a_waiters_index_walk_is_reused_until_the_index_changes_and_then_it_sees_the_new_prefix():
    sched, clock, room, texts = held_room(1)
    walks = count(sched.index, "match")
    for t in (0.01, 0.02, 0.03):
        clock.t = t
        assert room.pump() == []
    assert room._waiting["w0"].evaluations == 4 and walks == []  # evaluated 3 more times, walked only at the offer
    # p1 learns the prefix too: the next pump walks the index again and sends w0 to p1's empty queue
    text = texts["w0"]
    assert sched.index.block_stored("p1", block_hashes(text, BS)[:250], None, text[:250 * BS], BS, "GPU")
    clock.t = 0.04
    out = room.pump()
    # walked once, by the evaluation (a new index version): the dispatch commits the choice it made
    assert len(walks) == 1 and [(lc.request_id, d.prefill) for lc, d in out] == [("w0", "p1")]
    assert out[0][1].hit_tokens >= 4000 and room._matches == {}


def test_the_match_cache_forgets_a_request_that_left_and_never_matches_another_hash_list():
    f = LoadFrame(1.0)
    idx = HitIndex(BS)
    hashes = [1, 2, 3]
    m = idx.match(hashes, 3)
    f.keep_match("x", idx.version, hashes, 3, True, m)
    assert f.match("x", idx.version, hashes, 3, True) is m
    assert f.match("x", idx.version, list(hashes), 3, True) is None  # an equal list, not the same one
    assert f.match("x", idx.version, hashes, 2, True) is None and f.match("x", idx.version, hashes, 3, False) is None
    assert f.match("x", None, hashes, 3, True) is None  # an index without a version: walked every time
    idx.register("p0")
    assert f.match("x", idx.version, hashes, 3, True) is None


def test_every_index_change_bumps_its_version():
    idx = HitIndex(BS)
    seen = [idx.version]

    def bumped():
        seen.append(idx.version)
        return seen[-1] > seen[-2]

    idx.register("p0")
    assert bumped()
    text = toks(3, 64)
    idx.block_stored("p0", block_hashes(text, BS), None, text, BS, "GPU")
    assert bumped()
    idx.block_removed("p0", block_hashes(text, BS)[-1:], "GPU")
    assert bumped()
    idx.set_max_blocks("p0", 10)
    assert bumped()
    idx.all_cleared("p0")
    assert bumped()
    idx.drop_instance("p0")
    assert bumped()
    idx.unregister("p0")
    assert bumped()
    idx.match(block_hashes(text, BS), 4)
    assert idx.version == seen[-1]  # a walk changes nothing


def test_an_evaluations_record_reads_the_same_as_the_decisions_and_its_cheapest_prefill():
    sched, clock, room = world(prefill=3, defer=False)
    offer(sched, clock, room, "r0", 16000, 1)
    f = facts("x", 3000, 5)
    ev = sched.evaluate(f)
    cost = cheapest_prefill_s(ev.explanation)  # before the table is built: from the candidates
    d = sched.decide(f)
    assert isinstance(ev, Placement) and isinstance(d, Placement)
    assert json.dumps(ev.explanation, sort_keys=True) == json.dumps(d.explanation, sort_keys=True)
    rows = candidates(d.explanation, "prefill")
    assert cost == min(r["transfer_s"] + r["prefill_s"] for r in rows) == cheapest_prefill_s(d.explanation)
    assert cheapest_prefill_s(ev.explanation) == cost  # and after it was built


def test_an_arrival_that_goes_at_once_is_decided_through_its_evaluations_frame():
    """The room evaluates an arrival, then decides it when it goes at once: the decision reads the
    evaluation's frame (one index walk, not two) and places it as a fresh decide would."""
    def idle_world(room_on: bool):
        clock = Clock(0.0)
        sched = Scheduler([Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode")],
                          slo=SLO(ttft_s=5.0), block_size=BS, clock=clock, defer=room_on)
        prefix = toks(7, 4000)
        assert sched.index.block_stored("p1", block_hashes(prefix, BS), None, prefix, BS, "GPU")
        return sched, clock, prefix + toks(9, 300)

    sched, clock, text = idle_world(True)
    arrival = RequestFacts("a", len(text), block_hashes(text, BS), 8)
    room = WaitRoom(sched)
    walks, choices = count(sched.index, "match"), count(sched.policy, "choose_prefill")
    lc = RequestLifecycle(sched, RequestRecord("a", 0.0), clock)
    d = room.offer(lc, arrival)
    assert isinstance(d, Placement) and lc.phase is Phase.PLACED and room.counts["evaluations"] == 1
    assert len(walks) == 1 and room._matches == {}  # the decide reused the evaluation's walk, then forgot it
    assert len(choices) == 1  # and its choice: admitted and committed, not made again
    plain, clock2, _ = idle_world(False)
    fresh = RequestLifecycle(plain, RequestRecord("a", 0.0), clock2).decide(arrival)
    assert isinstance(fresh, Placement)
    assert (d.prefill, d.decode, d.hit_tokens, d.ttft_s) == (fresh.prefill, fresh.decode, fresh.hit_tokens,
                                                             fresh.ttft_s)
    assert d.prefill == "p1" and d.hit_tokens >= 4000


def test_a_pumps_dispatch_commits_the_choice_its_evaluation_made_and_places_as_a_fresh_decide():
    """A waiter a pump dispatches is decided through its evaluation's frame: the policy chooses once
    for both, and the placement is the one a decide from scratch gives in the same world."""
    def drained():
        sched, clock, room, texts = held_room(2)
        clock.t = 0.02
        sched.prefill_done("busy")  # p0's queue is empty: the waiters go there
        return sched, clock, room, texts

    sched, clock, room, _ = drained()
    choices = count(sched.policy, "choose_prefill")
    out = room.pump()
    assert [(lc.request_id, d.prefill) for lc, d in out] == [("w0", "p0"), ("w1", "p0")]
    assert len(choices) == 2  # one per waiter: its evaluation's, committed as it was
    # the same world, each waiter decided from scratch at the pump's instant, in the pump's order
    _, clock2, room2, _ = drained()
    for (_, d), w in zip(out, [room2._waiting["w0"], room2._waiting["w1"]], strict=True):
        room2._pop(w.facts.request_id)
        fresh = w.lc.decide(room2._remaining(w, clock2.t))
        assert isinstance(fresh, Placement)
        assert (d.prefill, d.decode, d.hit_tokens, d.queue_s, d.ttft_s, d.tbt_s) == (
            fresh.prefill, fresh.decode, fresh.hit_tokens, fresh.queue_s, fresh.ttft_s, fresh.tbt_s)
