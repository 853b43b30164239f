"""Deferred dispatch ("late binding"): requests wait at the gateway and are dispatched smallest
first (predicted prefill, or with ``size`` "pools" the share of both pools) when a prefill
instance's queue is short (issue 15).

Why: a scheduler that decides once, at arrival, in front of engines that run their queues first
come first served, admits under overload whichever request arrives while a queue happens to be
short; a long prompt then holds that queue and the short requests behind it are refused.
Goodput counts requests within the SLO, and serving the cheapest first (shortest job first) is
what maximises that count, but an engine cannot reorder what it was given. So the gateway keeps
the order: a request whose chosen prefill instance has more than ``horizon_s`` of predicted
queue waits here, holding no reservation, and as queues drain the cheapest waiting request goes.

Rules, for any policy (``defer=on`` among its parameters, as ``cost_admission``; conductor's default,
``Policy.wait_room``, when it admits against the SLO):

* on arrival the request is evaluated (``Scheduler.evaluate``, nothing reserved). Placed with the
  chosen instance's predicted queue within ``horizon_s``: decided (committed) at once. Placed
  with a longer queue, or refused for TTFT alone while drained queues would still meet it
  (``ttft_slo``): it waits. Anything else (unreachable SLO, TBT, cost admission, bad input,
  nothing healthy) is decided at once, exactly as without the wait room;
* its TTFT SLO runs from its arrival: every later evaluation gets the *remaining* SLO through
  ``RequestFacts.slo``, and once even drained queues cannot meet it the request is refused
  (429 ``deadline``, with the time it waited);
* ``pump`` goes through the waiting requests by job size, minus ``aging`` x seconds waited: by
  default (``size`` "prefill") the predicted prefill cost after cache hits (the cheapest
  candidate's); with ``size`` "pools" its share of both pools, prefill seconds over the prefill
  instances plus decode KV-seconds over the decode instances' KV (deferral_waiter.py ``_sized``);
  with ``share`` the uncached prefix a waiter shares with other waiters counts 1 / (how many share
  it) of its prefill (``_shared_sizes``: one prefill of it makes the others cheap),
  and dispatches each whose chosen instance's queue is within the horizon. It evaluates nobody
  while every prefill instance's queue exceeds the horizon (one ledger read), and stops after
  ``scan`` evaluations in a row that dispatched nobody (an evaluation costs a decision: at
  64P+64D a pump of 16 took ~30 ms);
* with ``spill`` (off by default), a waiting request whose chosen instance's queue exceeds the
  horizon is evaluated again with the busy instances avoided as destinations (``evaluate(facts,
  avoid=...)``: the policy's own choice among those with room; a busy holder still serves its
  prefix to a peer pull) and dispatched there if it meets its remaining TTFT SLO: the room is then
  work-conserving (an evaluation more per such waiter in a pump);
* with ``wait_holder`` (off by default), a request the policy would place on an instance within the
  horizon other than its cheapest one (the holder of its prefix), because the holder's queue exceeds
  the horizon, waits for the holder instead, while the holder still meets its remaining TTFT SLO
  (queue included) and the other instance's transfer + prefill costs more than ``holder_ratio`` x
  the holder's. The room, not the placement, then balances the queues, and a turn is not recomputed
  off its conversation's instance at the cost of the next arrivals' prefill capacity; the decision
  record's ``deferred.waited_for_holder`` names the holder it waited for;
* with ``reeval_s`` > 0 (0 by default), a pump skips a waiting request evaluated less than
  ``reeval_s`` seconds ago (its deadline and last chance still wake the room). In virtual time an
  evaluation is free; a live gateway pays about a millisecond of its event loop for each, and with
  ``scan`` 64 the simulator's room made ~38 per request on the live synthetic page's load (a waiter
  re-evaluated at every pump, ~10 a second, until it left; docs/experiments/live-baselines-synthetic.md);
* with ``eval_every_s`` > 0 (0 by default), the scans' evaluations are paid from a budget refilled
  one per ``eval_every_s`` seconds of the clock, holding at most ``scan``: a pump stops when it is
  spent (deadlines and last chances, the heap's, are never held for it). A live gateway pumps on every
  arrival, every request's end and a timer, so a full room ran the whole scan ~10 times a wall second
  (half its event loop); the simulator pumps less. The budget makes both spend the same evaluations
  per second of their clock, and bounds the share of the loop the room can take;
* with ``join`` (off by default), an arrival the policy would dispatch at once joins the room
  instead while anyone waits there (counted ``joined``), and ``next_wakeup`` is now: the pump that
  follows dispatches it only if no cheaper waiter takes the queue first. Without it the order holds
  only between pumps: an arrival finding a queue within the horizon overtakes every waiter. A joiner
  is evaluated again by that pump whatever ``reeval_s``, and until each joiner is reached no waiter
  ahead of it is skipped for ``reeval_s`` (docs/experiments/deferral.md);
* with ``last_chance`` (off by default), a waiting request is not held past its last chance:
  once its predicted TTFT behind the queue as it is leaves less than ``slack`` x its TTFT SLO of
  what remains, it is dispatched whatever the queue (shortest-job-first alone starves long
  prompts even where every request could have met the SLO). ``slack`` >= 1 holds only what would
  be refused today. Measured in docs/experiments/deferral.md: under overload last-chance
  dispatches crowd the queues at the last moment and cost far more than they save;
* the fairness floor (``floor_every`` k, 0 = off): shortest-job-first is paid for by the long
  prompts. Once k - 1 dispatches of the room in a row went by priority, the next is the floor's:
  the cheapest (by the same priority) of the waiters whose prompt is at least the
  ``floor_quantile`` (0.75) quantile of the last ``FLOOR_WINDOW`` (1000) prompts offered and whose last
  evaluation placed them within the SLO. It is dispatched under the same rule as any other (its
  chosen queue within the horizon); a floor turn that dispatches nobody gives the next evaluation
  back to the priority order. The decision record's ``deferred.floor`` and the request record's
  ``extra["floor"]`` mark the floor's dispatches, the room's counts ``floor`` counts them. Measured
  in docs/experiments/deferral.md: k = 8 keeps the longest quartile's attainment at or near conductor's
  without deferral, for 0-5.6 points of the wait room's gain (each long prompt served displaces 2-3
  shorter ones);
* with ``slack_aging`` (off by default) the priority is cost x (1 - waited / TTFT SLO) (minus
  ``aging`` x waited as before): a waiter's own cost is forgiven in proportion to the SLO it used,
  so a long prompt catches up with the short ones as its deadline nears.

The driver (the simulator's cluster, later the live gateway's proxy) owns one :class:`WaitRoom`
per scheduler and calls, on the scheduler's clock:

* ``offer(lc, facts)`` once per request at its arrival, *instead of* ``lc.decide(facts)``: the
  Placement (send the first leg) or Rejection (answer it) exactly as ``decide`` returns them, or
  None: the request waits (``lc.phase`` is WAITING) until ``pump`` releases it;
* ``pump()`` whenever queues may have drained: after every prefill finishes, on the periodic
  load poll, and at ``next_wakeup()`` (when a queue is predicted to reach the horizon or a
  waiting request's deadline passes; None with nobody waiting). It returns the
  ``(lifecycle, Placement | Rejection)`` pairs it decided, in order; each lifecycle is already
  PLACED or REJECTED: send the placed ones' first leg, answer the refused ones (429 +
  Retry-After);
* ``cancel(request_id)`` when the client goes away: the request leaves the room and its
  lifecycle is returned (it held nothing); the driver finishes it (aborted). A lifecycle that
  anyone finished while it waited is dropped by the next ``pump`` too.

With ``defer`` off (the default) ``offer`` is ``lc.decide(facts)``, nothing ever waits and
``pump`` touches nothing: decisions are byte-identical to a driver without a wait room.
Pure: no I/O, no awaits, the scheduler's injected clock. Beside this module: the room's settings
(deferral_params.py), a waiter and what an evaluation says about it, wait-for-holder included
(deferral_waiter.py), and the order a pump evaluates waiters in, fairness floor included
(deferral_order.py).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from predictors.telemetry import SLO
from scheduler.admission import resolve_slo, retry_seconds
from scheduler.deferral_order import PumpOrder
from scheduler.deferral_params import DeferParams, split_params
from scheduler.deferral_waiter import View, Waiter, holdable
from scheduler.frame import LoadFrame, MatchCache
from scheduler.types import OVER_SLO, Placement, Rejection, RequestFacts

if TYPE_CHECKING:
    from scheduler.lifecycle import RequestLifecycle
    from scheduler.scheduler import Scheduler

#: the reason a waiting request is refused with once its remaining SLO cannot be met
DEADLINE = "deadline"
#: the soonest ``next_wakeup`` puts a queue-drain wake-up (a deadline may come sooner)
MIN_WAKE_S = 0.05

Decided = tuple["RequestLifecycle", Placement | Rejection]

# the room's settings live in deferral_params.py; callers import them from here as before
__all__ = ["DEADLINE", "MIN_WAKE_S", "Decided", "DeferParams", "WaitRoom", "split_params"]


class WaitRoom:
    """Requests waiting at the gateway for a short prefill queue; see the module docstring."""

    def __init__(self, scheduler: Scheduler, params: DeferParams | None = None):
        self.scheduler = scheduler
        self.params = params if params is not None else scheduler.defer
        self._waiting: dict[str, Waiter] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # (expires_s, seq, id); stale entries skipped
        self._seq = itertools.count()
        self.counts: dict[str, int] = {"waited": 0, "dispatched": 0, DEADLINE: 0, "refused": 0, "cancelled": 0,
                                       "evaluations": 0}
        if self.params.floor_every:
            self.counts["floor"] = 0  # the floor's dispatches (a key only with it on: counts as they were)
        if self.params.join:
            self.counts["joined"] = 0  # arrivals that would have gone at once and joined the room instead
        self._joined = False  # an arrival joined since the last pump: pump now
        self._order = PumpOrder()  # cheapest first, with the fairness floor (deferral_order.py)
        # the evaluations a pump makes in a row without deciding anything share one instant's load
        # views (scheduler/frame.py); any decision throws the frame away. Each waiter's hit-index
        # answer is kept across pumps while the index is unchanged.
        self._frame: LoadFrame | None = None
        self._matches: MatchCache = {}
        # the evaluation budget (``eval_every_s``): a bucket of evaluations, refilled on the clock
        self._budget = float(self.params.scan)
        self._budget_at: float | None = None
        # ``share``: how many waiters hold each block hash (a chain hash names its whole prefix)
        self._blocks: Counter[int] = Counter()

    @property
    def enabled(self) -> bool:
        return self.params.enabled

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    # --- arrival ------------------------------------------------------------------------
    def offer(self, lc: RequestLifecycle, facts: RequestFacts) -> Placement | Rejection | None:
        """Decide now (as ``lc.decide(facts)``) or hold the request (None: ``lc`` is WAITING)."""
        if not self.params.enabled:
            return lc.decide(facts)
        if self.params.floor_every:
            self._order.offered(facts.prompt_tokens)
        sched = self.scheduler
        slo = resolve_slo(sched.slo, getattr(facts, "slo", None))
        if slo.ttft_s is None or getattr(facts, "request_id", None) in self._waiting:
            return lc.decide(facts)  # no deadline to order by (or a duplicate id): as without a wait room
        self._frame = None  # a new instant (offers come between pumps)
        ev = self._evaluate(facts)
        view = holdable(ev, slo, self.params, self._scale())
        # it would go now, but others wait: it joins them, only to take its turn (``join``)
        joined = view is None and self.params.join and bool(self._waiting) and isinstance(ev, Placement)
        if joined:
            view = holdable(ev, slo, self.params, self._scale(), join=True)
        frame, self._frame = self._frame, None
        if view is None:  # it goes now, decided through the evaluation's frame (nothing decided since)
            return self._decide_now(lc, facts, frame)
        now = sched.clock()
        # a joiner is evaluated again by the pump that comes at once, whatever ``reeval_s``
        w = Waiter(lc, facts, now, slo, view.cost_s, view.floor_s, next(self._seq),
                   evaluated_s=-math.inf if joined else now)
        w.update(view)
        if w.due_s <= now:  # it barely fits now: waiting could only lose it
            return self._decide_now(lc, facts, frame)
        lc.wait()
        self._waiting[facts.request_id] = w
        if self.params.share:
            self._blocks.update(facts.block_hashes)
        heapq.heappush(self._deadlines, (w.wake_s, w.seq, facts.request_id))
        self.counts["waited"] += 1
        if joined:
            self.counts["joined"] += 1
            self._joined = True  # next_wakeup: now
        return None

    def _decide_now(self, lc: RequestLifecycle, facts: RequestFacts, frame: LoadFrame | None
                    ) -> Placement | Rejection:
        """An arrival that goes at once: decided reusing the frame its evaluation just filled (the
        load views and its hit-index answer: one pass of the decision stages' reads, not two)."""
        try:
            return lc.decide(facts, frame=frame)
        finally:
            self._matches.pop(facts.request_id, None)

    def _evaluate(self, facts: RequestFacts, avoid: set[str] | None = None) -> Placement | Rejection:
        """``Scheduler.evaluate`` through the current frame (a new one after any decision)."""
        self.counts["evaluations"] += 1
        return self.scheduler.evaluate(facts, avoid or (), frame=self._current_frame())

    def _scale(self) -> tuple[int, int] | None:
        """The pools a "pools" job size is a share of (None: sized by prefill alone)."""
        return self.scheduler.pool_scale() if self.params.size == "pools" else None

    def _current_frame(self) -> LoadFrame:
        f = self._frame
        if f is None:
            f = self._frame = LoadFrame(self.scheduler.clock(), self._matches)
        return f

    def pump(self) -> list[Decided]:
        """Refuse the waiting requests whose deadline passed, then dispatch the cheapest waiting
        requests whose chosen prefill instance's queue is within the horizon."""
        self._frame = None  # a new instant: nothing carries over from before
        try:
            return self._pump()
        finally:
            self._frame = None

    def _pump(self) -> list[Decided]:
        joined, self._joined = self._joined, False
        if not self._waiting:
            self._deadlines.clear()
            self._matches.clear()
            return []
        sched = self.scheduler
        now = sched.clock()
        out: list[Decided] = []
        self._drop_finished()
        while self._deadlines and self._deadlines[0][0] <= now:
            wake, seq, rid = heapq.heappop(self._deadlines)
            w = self._waiting.get(rid)
            if w is not None and w.seq == seq and w.wake_s == wake:  # else stale: gone, or moved
                d = self._reconsider(w, now)
                if d is not None:
                    out.append(d)
        horizon = self.params.horizon_s
        if not self._waiting:
            return out
        if sched.min_prefill_queue_s(frame=self._current_frame()) > horizon:
            return out
        misses = 0
        fresh = now - self.params.reeval_s  # evaluated after this: not again in this pump
        # joiners not yet evaluated by a pump: until each is reached, no waiter ahead is skipped for
        # ``reeval_s``, or a joiner would overtake the cheaper waiters it joined the room behind
        joiners = sum(w.evaluated_s == -math.inf for w in self._waiting.values()) \
            if joined and self.params.reeval_s > 0 else 0
        budget = self._refill(now)
        # each is evaluated again even if the instance it chose last is still busy: skipping those
        # (the policy may choose another instance now) cost 1-5 points of attainment
        for w, floor_turn in self._order.waiters(self._waiting, now, self.params,
                                                    self._shared_sizes() if self.params.share else None):
            if self.params.reeval_s > 0 and w.evaluated_s > fresh and not joiners:
                continue  # (its deadline and last chance still wake the room: the heap above)
            if joiners and w.evaluated_s == -math.inf:
                joiners -= 1
            if budget and self._budget < 1:
                break  # spent: the next pump goes on (deadlines and last chances never wait for it)
            spent = self.counts["evaluations"]
            d = self._reconsider(w, now)
            self._budget -= self.counts["evaluations"] - spent
            if d is not None:
                out.append(d)
            if d is not None and isinstance(d[1], Placement):
                misses = 0
                if self.params.floor_every:
                    self._order.dispatched(floor_turn)
                    if floor_turn:
                        self.counts["floor"] += 1
                        d[1].explanation["deferred"]["floor"] = True
                        d[0].record.extra["floor"] = True
                if sched.min_prefill_queue_s(frame=self._current_frame()) > horizon:
                    break
            else:
                misses += 1
                if misses >= self.params.scan:
                    break
        return out

    def _refill(self, now: float) -> bool:
        """Credit the evaluation budget for the time since the last pump; False: no budget."""
        every = self.params.eval_every_s
        if every <= 0:
            return False
        if self._budget_at is not None:
            self._budget = min(float(self.params.scan), self._budget + (now - self._budget_at) / every)
        self._budget_at = now
        return True

    def _reconsider(self, w: Waiter, now: float) -> Decided | None:
        """Evaluate a waiting request with its remaining SLO: dispatch it, keep it waiting (None)
        or refuse it."""
        if w.slo.ttft_s is not None and now - w.arrived_s >= w.slo.ttft_s:
            return self._expire(w, now)  # a late pump (a starved loop): no SLO left to evaluate against
        facts = self._remaining(w, now)
        ev = self._evaluate(facts)
        w.evaluations += 1
        w.evaluated_s = now
        if isinstance(ev, Rejection) and ev.reason == "ttft_slo_unreachable":
            return self._expire(w, now)
        view = holdable(ev, w.slo, self.params, self._scale())
        if view is None:  # dispatch, or refused for another reason: as without a wait room
            return self._decide(w, facts, now)
        if self.params.spill:
            spilled = self._spill(w, facts, now, view)
            if spilled is not None:
                return spilled
        before = w.wake_s
        w.update(view)  # a prefix cached or evicted, a queue grown or drained: cost, chance, deadline move
        if isinstance(ev, Placement) and w.due_s <= now:
            return self._decide(w, facts, now)  # its last chance: it meets the remaining SLO behind the queue
        if w.expires_s <= now:
            return self._expire(w, now)
        if w.wake_s != before:
            heapq.heappush(self._deadlines, (w.wake_s, w.seq, w.facts.request_id))
        return None

    def _spill(self, w: Waiter, facts: RequestFacts, now: float, view: View) -> Decided | None:
        """Work conservation (``spill``): the policy's choice among the prefill instances whose queue
        is within the horizon, dispatched there if it meets the remaining SLO; None: keep waiting.
        Without it the cheapest waiters all wait for the busy instance holding their prefix, the
        pump gives up on them and the instances with room stay idle. ``spill_ratio`` bounds the work
        a spill may add: its transfer + prefill there against its cheapest anywhere (``view``)."""
        horizon = self.params.horizon_s
        queues = self.scheduler.prefill_queues_s(frame=self._current_frame())
        busy = {i for i, q in queues.items() if q > horizon}
        if not busy or len(busy) == len(queues):
            return None
        ev = self._evaluate(facts, busy)
        w.evaluations += 1
        ttft = facts.slo.ttft_s if facts.slo is not None else None
        if not isinstance(ev, Placement) or ev.queue_s > horizon or ttft is None or ev.ttft_s > ttft:
            return None
        if ev.transfer_s + ev.prefill_s > self.params.spill_ratio * view.cost_s:
            return None
        d = self._decide(w, facts, now, busy)
        d[1].explanation["deferred"]["spilled_from"] = view.instance
        return d

    def _remaining(self, w: Waiter, now: float) -> RequestFacts:
        ttft = w.slo.ttft_s
        assert ttft is not None, "only a request with a TTFT SLO waits"
        return dataclasses.replace(w.facts, slo=SLO(ttft_s=ttft - (now - w.arrived_s), tbt_s=w.slo.tbt_s))

    def _decide(self, w: Waiter, facts: RequestFacts, now: float, avoid: set[str] | None = None) -> Decided:
        """Dispatch (or refuse) a waiter its evaluation just judged: decided through that
        evaluation's frame (nothing decided since), so its choice is admitted, not made again."""
        frame = self._frame
        self._leave(w)
        d = w.lc.decide(facts, avoid=avoid or (), frame=frame)
        d.explanation["deferred"] = self._note(w, now)
        self.counts["dispatched" if isinstance(d, Placement) else "refused"] += 1
        return w.lc, d

    def _expire(self, w: Waiter, now: float) -> Decided:
        """Refuse a waiting request whose remaining SLO even drained queues cannot meet."""
        self._leave(w)
        sched = self.scheduler
        remaining = (w.slo.ttft_s or 0.0) - (now - w.arrived_s)
        msg = (f"deadline: waited {now - w.arrived_s:.3f}s at the gateway for a prefill queue within "
               f"{self.params.horizon_s:g}s; the remaining {remaining:.3f}s of the TTFT SLO is less than the "
               f"{w.floor_s:.3f}s it needs even with no queue")
        retry = retry_seconds(max(0.0, sched.min_prefill_queue_s(now) - self.params.horizon_s))
        d = sched.refuse(w.facts, OVER_SLO, DEADLINE, msg, retry)
        d.explanation["deferred"] = self._note(w, now)
        w.lc.refuse(d)
        self.counts[DEADLINE] += 1
        return w.lc, d

    def _note(self, w: Waiter, now: float) -> dict[str, Any]:
        """What the decision record says about the wait."""
        return {"arrived_s": w.arrived_s, "waited_s": now - w.arrived_s, "slo_ttft_s": w.slo.ttft_s,
                "remaining_ttft_s": None if w.slo.ttft_s is None else w.slo.ttft_s - (now - w.arrived_s),
                "cost_s": w.cost_s, "size_s": w.size_s, "floor_s": w.floor_s, "horizon_s": self.params.horizon_s,
                "last_chance": w.due_s <= now,
                "evaluations": w.evaluations, **({"waited_for_holder": w.held_for} if w.held_for else {})}

    def _leave(self, w: Waiter) -> None:
        """A waiter goes (decided now): what it decides changes the world the frame saw."""
        self._frame = None
        self._pop(w.facts.request_id)

    def _pop(self, rid: str) -> Waiter | None:
        """Take a waiter out of the room's books."""
        w = self._waiting.pop(rid, None)
        self._matches.pop(rid, None)
        if w is not None and self.params.share:
            c = self._blocks
            for h in w.facts.block_hashes:
                c[h] -= 1
                if c[h] <= 0:
                    del c[h]
        return w

    def _shared_sizes(self) -> Callable[[Waiter], float]:
        """``share``: a waiter's size with its prefill cost shared: the uncached prefix it shares
        with other waiters counts 1 / (how many share it). Only the prefill part: each holds its
        own KV while decoding. (The pools' scale is read once per pump.)"""
        scale = self._scale()
        per = max(scale[0], 1) if scale is not None else 1

        def size(w: Waiter) -> float:
            f = self._share(w)
            return w.size_s if f >= 1.0 else w.size_s - w.cost_s / per * (1.0 - f)
        return size

    def _share(self, w: Waiter) -> float:
        """The share of a waiter's uncached blocks it pays for: those it shares with other waiters
        count 1 / (how many share them). The counts only fall along a chain, so the shared end is
        found by bisection."""
        hs = w.facts.block_hashes
        lo = min(w.hit_tokens // self.scheduler.block_size, len(hs))
        own = len(hs) - lo
        c = self._blocks
        if own <= 0 or c[hs[lo]] < 2:
            return 1.0
        end = bisect_right(hs, -2, lo, len(hs), key=lambda h: -c[h])  # the first block fewer than 2 hold
        shared = end - lo
        return (shared / c[hs[end - 1]] + own - shared) / own

    # --- the client went away -----------------------------------------------------------
    def cancel(self, request_id: str) -> RequestLifecycle | None:
        """Take a waiting request out (it held nothing); its lifecycle, for the driver to finish."""
        w = self._pop(request_id)
        if w is None:
            return None
        self.counts["cancelled"] += 1
        return w.lc

    def _drop_finished(self) -> None:
        for rid in [rid for rid, w in self._waiting.items() if w.lc.done]:
            self._pop(rid)
            self.counts["cancelled"] += 1

    # --- when to pump next ---------------------------------------------------------------
    def next_wakeup(self) -> float | None:
        """The earliest time a pump may decide something a prefill completion would not prompt:
        a waiting request's deadline, or the shortest queue draining to the horizon (the ledger
        credits the head's progress). None with nobody waiting."""
        if not self._waiting:
            return None
        sched = self.scheduler
        now = sched.clock()
        if self._joined:
            return now  # an arrival waits for its turn: the pump decides whose it is
        t = math.inf
        while self._deadlines:
            wake, seq, rid = self._deadlines[0]
            w = self._waiting.get(rid)
            if w is not None and w.seq == seq and w.wake_s == wake:
                t = wake
                break
            heapq.heappop(self._deadlines)  # stale: gone, or its deadline moved
        q = sched.min_prefill_queue_s(now)
        if math.isfinite(q) and q > self.params.horizon_s:
            # at least MIN_WAKE_S on: a head running past its prediction stops the ledger's drain
            t = min(t, now + max(q - self.params.horizon_s, MIN_WAKE_S))
        return None if math.isinf(t) else max(t, now)

    def snapshot(self) -> dict[str, Any]:
        """For /debug and reports: who waits, and how many went which way."""
        now = self.scheduler.clock()
        return {"enabled": self.params.enabled, "horizon_s": self.params.horizon_s, "aging": self.params.aging,
                "waiting": len(self._waiting), "counts": dict(self.counts),
                "oldest_wait_s": max((now - w.arrived_s for w in self._waiting.values()), default=0.0)}

