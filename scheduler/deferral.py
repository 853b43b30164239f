"""Deferred dispatch ("late binding"): requests wait at the gateway and are dispatched cheapest
predicted prefill first when a prefill instance's queue is short (issue 15).

Why: a scheduler that decides once, at arrival, in front of engines that run their queues first
come first served, admits under overload whichever request arrives while a queue happens to be
short; a long prompt then holds that queue and the short requests behind it are refused.
Goodput counts requests within the SLO, and serving the cheapest first (shortest job first) is
what maximises that count, but an engine cannot reorder what it was given. So the gateway keeps
the order: a request whose chosen prefill instance has more than ``horizon_s`` of predicted
queue waits here, holding no reservation, and as queues drain the cheapest waiting request goes.

Rules, for any policy (``defer=on`` among its parameters, as ``cost_admission``):

* on arrival the request is evaluated (``Scheduler.evaluate``, nothing reserved). Placed with the
  chosen instance's predicted queue within ``horizon_s``: decided (committed) at once. Placed
  with a longer queue, or refused for TTFT alone while drained queues would still meet it
  (``ttft_slo``): it waits. Anything else (unreachable SLO, TBT, cost admission, bad input,
  nothing healthy) is decided at once, exactly as without the wait room;
* its TTFT SLO runs from its arrival: every later evaluation gets the *remaining* SLO through
  ``RequestFacts.slo``, and once even drained queues cannot meet it the request is refused
  (429 ``deadline``, with the time it waited);
* ``pump`` goes through the waiting requests by predicted prefill cost after cache hits (the
  cheapest candidate's), minus ``aging`` x seconds waited, and dispatches each whose chosen
  instance's queue is within the horizon. It evaluates nobody while every prefill instance's
  queue exceeds the horizon (one ledger read), and stops after ``scan`` evaluations in a row that
  dispatched nobody (an evaluation costs a decision: at 64P+64D a pump of 16 took ~30 ms);
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
* with ``last_chance`` (off by default), a waiting request is not held past its last chance:
  once its predicted TTFT behind the queue as it is leaves less than ``slack`` x its TTFT SLO of
  what remains, it is dispatched whatever the queue (shortest-job-first alone starves long
  prompts even where every request could have met the SLO). ``slack`` >= 1 holds only what would
  be refused today. Measured in docs/experiments/deferral.md: under overload last-chance
  dispatches crowd the queues at the last moment and cost far more than they save;
* the fairness floor (``floor_every`` k, 0 = off): shortest-job-first is paid for by the long
  prompts. Once k - 1 dispatches of the room in a row went by priority, the next is the floor's:
  the cheapest (by the same priority) of the waiters whose prompt is at least the
  ``floor_quantile`` (0.75) quantile of the last ``FLOOR_WINDOW`` prompts offered and whose last
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
Pure: no I/O, no awaits, the scheduler's injected clock.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from predictors.telemetry import SLO
from scheduler.admission import resolve_slo, retry_seconds
from scheduler.explain import candidates, cheapest_prefill_s
from scheduler.frame import LoadFrame, MatchCache
from scheduler.policies.base import _coerce  # the same parsing as every policy parameter
from scheduler.types import OVER_SLO, Placement, Rejection, RequestFacts

if TYPE_CHECKING:
    from scheduler.lifecycle import RequestLifecycle
    from scheduler.scheduler import Scheduler

#: policy parameters the scheduler takes for itself (any policy accepts them) -> field name
PARAM_KEYS = {"defer": "enabled", "defer_horizon_s": "horizon_s", "defer_aging": "aging",
              "defer_scan": "scan", "defer_last_chance": "last_chance", "defer_slack": "slack",
              "defer_spill": "spill", "defer_spill_ratio": "spill_ratio",
              "defer_wait_holder": "wait_holder", "defer_holder_ratio": "holder_ratio",
              "defer_holder_fallback": "holder_fallback", "defer_floor_every": "floor_every",
              "defer_floor_quantile": "floor_quantile", "defer_slack_aging": "slack_aging",
              "defer_reeval_s": "reeval_s"}
#: the reason a waiting request is refused with once its remaining SLO cannot be met
DEADLINE = "deadline"
#: the soonest ``next_wakeup`` puts a queue-drain wake-up (a deadline may come sooner)
MIN_WAKE_S = 0.05
#: the fairness floor's long class is cut at a quantile of this many most recent prompts offered
FLOOR_WINDOW = 1000
#: refusals a wait can cure: the queue is long now, drained queues would meet the SLO
_TRANSIENT = "ttft_slo"

Decided = tuple["RequestLifecycle", Placement | Rejection]


@dataclass(frozen=True)
class DeferParams:
    enabled: bool = False
    horizon_s: float = 1.0  # predicted queue (s) within which a request is dispatched at once
    aging: float = 0.0  # seconds of predicted cost forgiven per second waited (0: pure SJF)
    scan: int = 4  # evaluations in a row without a dispatch before a pump gives up (keeps it cheap)
    last_chance: bool = False  # dispatch a waiting request behind a long queue before it is too late
    slack: float = 0.1  # with last_chance: share of the TTFT SLO kept in hand then
    spill: bool = False  # a waiter whose chosen instance is busy may go to one with room if it meets its SLO there
    spill_ratio: float = math.inf  # with spill: only if its prefill there costs at most this x its cheapest
    # a request the policy would place off its cheapest instance (the prefix holder) while that one's queue
    # exceeds the horizon waits for it instead, if it meets its remaining TTFT SLO there and the other
    # instance's prefill costs more than holder_ratio x the holder's (see _wait_for_holder)
    wait_holder: bool = False
    holder_ratio: float = 1.5
    # with wait_holder: only while the policy's choice would still meet the SLO after the holder's queue
    # drained to the horizon (the wait never costs the request its way out)
    holder_fallback: bool = False
    # the fairness floor (0: off): every floor_every-th dispatch of the room goes to a long prompt (at least
    # the floor_quantile of the recent prompts offered), the cheapest its last evaluation placed within the SLO
    floor_every: int = 0
    floor_quantile: float = 0.75
    # priority = cost x (1 - waited / TTFT SLO) (- aging x waited): a waiter's own cost is forgiven as
    # its SLO runs out, so a long prompt catches up with the short ones before its deadline
    slack_aging: bool = False
    # a pump evaluates a waiting request again only once this many seconds passed since its last
    # evaluation (0: at every pump). Virtual time makes evaluations free; a live gateway pays ~1 ms
    # of its event loop for each (docs/experiments/live-baselines-synthetic.md)
    reeval_s: float = 0.0

    def __post_init__(self) -> None:
        for name, v in (("defer_horizon_s", self.horizon_s), ("defer_aging", self.aging), ("defer_slack", self.slack),
                        ("defer_reeval_s", self.reeval_s)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if not (isinstance(self.holder_ratio, (int, float)) and not isinstance(self.holder_ratio, bool)
                and self.holder_ratio >= 1):
            raise ValueError(f"defer_holder_ratio must be a number >= 1, got {self.holder_ratio!r}")
        r = self.spill_ratio  # inf: any cost
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and r >= 1):
            raise ValueError(f"defer_spill_ratio must be a number >= 1 (inf: any cost), got {r!r}")
        if not isinstance(self.scan, int) or isinstance(self.scan, bool) or self.scan < 1:
            raise ValueError(f"defer_scan must be a positive integer, got {self.scan!r}")
        k = self.floor_every
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"defer_floor_every must be an integer >= 0 (0: off), got {k!r}")
        q = self.floor_quantile
        if not (isinstance(q, (int, float)) and not isinstance(q, bool) and 0 <= q <= 1):
            raise ValueError(f"defer_floor_quantile must be a number in [0, 1], got {q!r}")


def split_params(policy_params: dict[str, Any]) -> tuple[DeferParams, dict[str, Any]]:
    """The deferral parameters out of a policy's raw parameters (TOML natives or
    ``--policy-param`` strings), and the rest for the policy."""
    rest = dict(policy_params)
    kw: dict[str, Any] = {}
    for key, name in PARAM_KEYS.items():
        if key in rest:
            hint = {"enabled": bool, "last_chance": bool, "spill": bool, "wait_holder": bool,
                    "holder_fallback": bool, "scan": int, "floor_every": int,
                    "slack_aging": bool}.get(name, float)
            kw[name] = _coerce(key, hint, rest.pop(key))
    return DeferParams(**kw), rest


@dataclass(slots=True)
class _Waiter:
    lc: RequestLifecycle
    facts: RequestFacts
    arrived_s: float
    slo: SLO  # the request's whole SLO (configured, with its overrides)
    cost_s: float  # predicted prefill (+ pull) seconds on its cheapest candidate, after cache hits
    floor_s: float  # its best TTFT with every queue drained
    seq: int
    instance: str | None = None  # the prefill instance its last evaluation chose
    due_s: float = math.inf  # its last chance: dispatched then behind the queue it was last evaluated at
    evaluations: int = 1
    evaluated_s: float = -math.inf  # when it was last evaluated (``reeval_s`` spaces a pump's evaluations)
    held_for: str | None = None  # wait_holder: the prefix holder it last waited for rather than go elsewhere
    latest_s: float = math.inf  # the latest start behind the queue it was last evaluated at (inf: refused then)

    @property
    def expires_s(self) -> float:
        """When the remaining SLO falls below the drained-queue TTFT (inf without a TTFT SLO)."""
        ttft = self.slo.ttft_s
        return math.inf if ttft is None else self.arrived_s + ttft - self.floor_s

    @property
    def wake_s(self) -> float:
        """When the room must look at it again whatever the queues: its last chance or its deadline."""
        return min(self.due_s, self.expires_s)

    def update(self, v: _View) -> None:
        self.cost_s, self.floor_s, self.instance = v.cost_s, v.floor_s, v.instance
        if v.instead_of is not None:
            self.held_for = v.instance
        ttft = self.slo.ttft_s
        self.latest_s = math.inf if v.ttft_s is None or ttft is None else self.arrived_s + ttft - v.ttft_s
        self.due_s = math.inf if v.ttft_s is None or ttft is None or v.slack_s < 0 \
            else self.latest_s - v.slack_s


@dataclass(slots=True)
class _View:
    """What one evaluation says about a request that may wait."""

    cost_s: float
    floor_s: float
    instance: str | None
    ttft_s: float | None  # predicted TTFT behind the queue (None: refused, it does not fit now)
    slack_s: float  # < 0: no last chance
    instead_of: str | None = None  # wait_holder: the instance the policy chose, passed over for ``instance``


class WaitRoom:
    """Requests waiting at the gateway for a short prefill queue; see the module docstring."""

    def __init__(self, scheduler: Scheduler, params: DeferParams | None = None):
        self.scheduler = scheduler
        self.params = params if params is not None else scheduler.defer
        self._waiting: dict[str, _Waiter] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # (expires_s, seq, id); stale entries skipped
        self._seq = itertools.count()
        self.counts: dict[str, int] = {"waited": 0, "dispatched": 0, DEADLINE: 0, "refused": 0, "cancelled": 0}
        if self.params.floor_every:
            self.counts["floor"] = 0  # the floor's dispatches (a key only with it on: counts as they were)
        self._since_floor = 0  # the room's dispatches by priority since the floor's last one
        self._lengths: deque[int] = deque(maxlen=FLOOR_WINDOW)  # with the floor: recent prompts offered
        # the evaluations a pump makes in a row without deciding anything share one instant's load
        # views (scheduler/frame.py); any decision throws the frame away. Each waiter's hit-index
        # answer is kept across pumps while the index is unchanged.
        self._frame: LoadFrame | None = None
        self._matches: MatchCache = {}

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
            self._lengths.append(facts.prompt_tokens)
        sched = self.scheduler
        slo = resolve_slo(sched.slo, getattr(facts, "slo", None))
        if slo.ttft_s is None or getattr(facts, "request_id", None) in self._waiting:
            return lc.decide(facts)  # no deadline to order by (or a duplicate id): as without a wait room
        self._frame = None  # a new instant (offers come between pumps)
        view = self._holdable(self._evaluate(facts), slo)
        self._frame = None
        if view is None:
            self._matches.pop(facts.request_id, None)
            return lc.decide(facts)
        now = sched.clock()
        w = _Waiter(lc, facts, now, slo, view.cost_s, view.floor_s, next(self._seq), evaluated_s=now)
        w.update(view)
        if w.due_s <= now:  # it barely fits now: waiting could only lose it
            self._matches.pop(facts.request_id, None)
            return lc.decide(facts)
        lc.wait()
        self._waiting[facts.request_id] = w
        heapq.heappush(self._deadlines, (w.wake_s, w.seq, facts.request_id))
        self.counts["waited"] += 1
        return None

    def _holdable(self, d: Placement | Rejection, slo: SLO) -> _View | None:
        """What waiting is judged on, when it may help: placed behind a queue longer than the
        horizon, or refused for TTFT alone while drained queues meet it; None: decide now."""
        p = self.params
        slack = p.slack * (slo.ttft_s or 0.0) if p.last_chance else -1.0
        if isinstance(d, Placement):
            if d.queue_s <= p.horizon_s:
                return _wait_for_holder(d, p, slack) if p.wait_holder else None
            return _view(d.explanation, d.ttft_s, slack)
        if d.reason != _TRANSIENT or any(v.get("reason") != _TRANSIENT for v in d.explanation.get("violations", ())):
            return None
        return _view(d.explanation, None, slack)

    # --- dispatch -----------------------------------------------------------------------
    def _evaluate(self, facts: RequestFacts, avoid: set[str] | None = None) -> Placement | Rejection:
        """``Scheduler.evaluate`` through the current frame (a new one after any decision)."""
        return self.scheduler.evaluate(facts, avoid or (), frame=self._current_frame())

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
        # each is evaluated again even if the instance it chose last is still busy: skipping those
        # (the policy may choose another instance now) cost 1-5 points of attainment
        for w, floor_turn in self._order(now):
            if self.params.reeval_s > 0 and w.evaluated_s > fresh:
                continue  # (its deadline and last chance still wake the room: the heap above)
            d = self._reconsider(w, now)
            if d is not None:
                out.append(d)
            if d is not None and isinstance(d[1], Placement):
                misses = 0
                if self.params.floor_every:
                    self._since_floor = 0 if floor_turn else self._since_floor + 1
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

    def _order(self, now: float) -> Iterator[tuple[_Waiter, bool]]:
        """The waiters in the order a pump evaluates them, each with whether it is the floor's turn.

        Cheapest priority first (cost minus ``aging`` x waited; with ``slack_aging`` the cost is
        scaled by the share of the TTFT SLO still left). With the fairness floor (``floor_every`` k),
        once k - 1 dispatches in a row went by priority the next one is the floor's: the cheapest by
        the same priority among the long prompts (at least ``floor_quantile`` of the recent prompts
        offered) that their last evaluation placed within the SLO. Cheapest, not least slack: a long
        prompt with its prefix cached costs a fraction of an uncached one, and the floor is paid in
        prefill capacity (least slack first lost 13-24 points at conversation 30 s / 12x). A floor
        turn that dispatches nobody hands the next evaluation back to the priority order, so the
        floor never spends the pump's budget alone. The count since the floor's last dispatch runs
        across pumps."""
        p = self.params
        aging = p.aging
        if p.slack_aging:
            def key(w: _Waiter) -> tuple[float, int]:
                left = 1.0 - (now - w.arrived_s) / (w.slo.ttft_s or math.inf)
                return w.cost_s * max(left, 0.0) + aging * w.arrived_s, w.seq
        else:
            def key(w: _Waiter) -> tuple[float, int]:
                return w.cost_s + aging * w.arrived_s, w.seq
        by_priority = sorted(self._waiting.values(), key=key)
        if not p.floor_every:
            for w in by_priority:
                yield w, False
            return
        cut = _quantile(self._lengths, p.floor_quantile)
        urgent = [w for w in by_priority if w.latest_s < math.inf and w.facts.prompt_tokens >= cut]
        tried: set[int] = set()
        i = j = 0
        floor_missed = False
        while True:
            nxt: _Waiter | None = None
            floor_turn = False
            if self._since_floor >= p.floor_every - 1 and not floor_missed:
                while j < len(urgent) and urgent[j].seq in tried:
                    j += 1
                if j < len(urgent):
                    nxt, floor_turn = urgent[j], True
            if nxt is None:
                while i < len(by_priority) and by_priority[i].seq in tried:
                    i += 1
                if i == len(by_priority):
                    return
                nxt = by_priority[i]
            tried.add(nxt.seq)
            yield nxt, floor_turn
            # a floor turn whose waiter still waits: the next evaluation is the priority order's
            floor_missed = floor_turn and nxt.facts.request_id in self._waiting

    def _reconsider(self, w: _Waiter, now: float) -> Decided | None:
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
        view = self._holdable(ev, w.slo)
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

    def _spill(self, w: _Waiter, facts: RequestFacts, now: float, view: _View) -> Decided | None:
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

    def _remaining(self, w: _Waiter, now: float) -> RequestFacts:
        ttft = w.slo.ttft_s
        assert ttft is not None, "only a request with a TTFT SLO waits"
        return dataclasses.replace(w.facts, slo=SLO(ttft_s=ttft - (now - w.arrived_s), tbt_s=w.slo.tbt_s))

    def _decide(self, w: _Waiter, facts: RequestFacts, now: float, avoid: set[str] | None = None) -> Decided:
        self._leave(w)
        d = w.lc.decide(facts, avoid=avoid or ())
        d.explanation["deferred"] = self._note(w, now)
        self.counts["dispatched" if isinstance(d, Placement) else "refused"] += 1
        return w.lc, d

    def _expire(self, w: _Waiter, now: float) -> Decided:
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

    def _note(self, w: _Waiter, now: float) -> dict[str, Any]:
        """What the decision record says about the wait."""
        return {"arrived_s": w.arrived_s, "waited_s": now - w.arrived_s, "slo_ttft_s": w.slo.ttft_s,
                "remaining_ttft_s": None if w.slo.ttft_s is None else w.slo.ttft_s - (now - w.arrived_s),
                "cost_s": w.cost_s, "floor_s": w.floor_s, "horizon_s": self.params.horizon_s,
                "last_chance": w.due_s <= now,
                "evaluations": w.evaluations, **({"waited_for_holder": w.held_for} if w.held_for else {})}

    def _leave(self, w: _Waiter) -> None:
        """A waiter goes (decided now): what it decides changes the world the frame saw."""
        self._frame = None
        rid = w.facts.request_id
        del self._waiting[rid]
        self._matches.pop(rid, None)

    # --- the client went away -----------------------------------------------------------
    def cancel(self, request_id: str) -> RequestLifecycle | None:
        """Take a waiting request out (it held nothing); its lifecycle, for the driver to finish."""
        w = self._waiting.pop(request_id, None)
        self._matches.pop(request_id, None)
        if w is None:
            return None
        self.counts["cancelled"] += 1
        return w.lc

    def _drop_finished(self) -> None:
        for rid in [rid for rid, w in self._waiting.items() if w.lc.done]:
            del self._waiting[rid]
            self._matches.pop(rid, None)
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


def _quantile(xs: deque[int], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs`` (the smallest x with at least q of them <= x); -inf if empty."""
    if not xs:
        return -math.inf
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _view(record: dict[str, Any], ttft_s: float | None, slack_s: float) -> _View:
    """From a decision record: the cheapest candidate's transfer + prefill (the cost), the best TTFT
    with drained queues (plus the chosen pair's KV shipment and first step), the chosen instance."""
    cost = cheapest_prefill_s(record)
    terms = record.get("terms") or {}
    floor = cost + terms.get("kv_transfer_s", 0.0) + terms.get("decode_first_step_s", 0.0)
    return _View(cost, floor, (record.get("chosen") or {}).get("prefill"), ttft_s, slack_s)


def _wait_for_holder(d: Placement, p: DeferParams, slack_s: float) -> _View | None:
    """``wait_holder``: the view to wait on when ``d`` sends the request off its cheapest instance
    (the holder of its longest prefix, or a pull from it) because that one's queue is long; None:
    dispatch ``d``. Under deferral the wait room already balances the queues, and a placement
    elsewhere recomputes the prefix, spending prefill capacity the next arrivals need. It waits only
    if the holder's queue exceeds the horizon, the chosen instance's prefill costs more than
    ``holder_ratio`` x the holder's, and the holder meets what is left of the TTFT SLO, queue included
    (once it no longer does, the policy's choice stands); with ``holder_fallback`` also only while
    the policy's choice would still meet it after the holder's queue drained to the horizon."""
    rec = d.explanation
    rows = candidates(rec, "prefill")
    if not rows:
        return None
    best = min(rows, key=lambda r: (r["transfer_s"] + r["prefill_s"], r["ttft_s"]))
    chosen = next((r for r in rows if r["id"] == d.prefill), None)
    if chosen is None or best["id"] == d.prefill or best["queue_s"] <= p.horizon_s:
        return None
    cost = best["transfer_s"] + best["prefill_s"]
    if chosen["transfer_s"] + chosen["prefill_s"] <= p.holder_ratio * cost:
        return None
    terms = rec.get("terms") or {}
    tail = terms.get("kv_transfer_s", 0.0) + terms.get("decode_first_step_s", 0.0)
    limit = (rec.get("slo") or {}).get("ttft_s")  # what is left of it; a priority class admits up to a share
    if limit is None:
        return None
    limit *= rec.get("admit_fraction", 1.0)
    if best["ttft_s"] + tail > limit:
        return None
    if p.holder_fallback and chosen["ttft_s"] + tail + best["queue_s"] - p.horizon_s > limit:
        return None  # by the time the holder has room, the policy's choice would be too late
    return _View(cost, cost + tail, best["id"], best["ttft_s"] + tail, slack_s, instead_of=d.prefill)
