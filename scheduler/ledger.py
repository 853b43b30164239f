"""The ledger: the scheduler's own view of load, updated at decision time, not polled.

Like Dynamo's active-load tracker, load is what the scheduler itself has placed: per prefill
instance the queued prefill work (uncached tokens and their predicted seconds), per decode
instance the running sequences and the KV tokens they hold (prompt + max_tokens, the most
they will hold). Every placement is a :class:`Reservation`; ``prefill_done`` moves its prefill
work off the prefill instance, ``release`` returns everything it still holds, exactly once.

Observed engine metrics (``observe``) reconcile the view: load the scheduler did not place
(another gateway, requests it lost track of) raises the effective figures, never lowers them,
and an observation older than ``observe_ttl_s`` is ignored.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from predictors.base import DecodeState, PrefillState
from scheduler.policies.base import _coerce  # the same parsing as every policy parameter

_prefill_state = tuple.__new__  # a PrefillState built in C (its generated __new__ is a Python call)

#: Seconds over which :meth:`Ledger.decode_load` averages the cluster's decode load.
DECODE_LOAD_TAU_S = 1.0
#: Weight of each observation in a decode instance's learned ``kv_share`` (an EWMA over polls).
KV_SHARE_ALPHA = 0.3
#: A ``kv_share`` sample needs the admitted reservations to hold this share of the capacity (a few
#: sequences say little about the mix), and is floored (a stale metric against a busy ledger).
KV_SHARE_MIN_HELD = 0.05
KV_SHARE_FLOOR = 0.2
#: Output tokens a second beyond any real decode (a thousand times the fastest): a reservation
#: predicted to decode faster has a span too short for :meth:`Ledger.decode_kv_wait`'s sweep.
_MAX_DECODE_RATE = 1e6


@dataclass(slots=True)
class Reservation:
    request_id: str
    prefill: str
    decode: str
    prefill_tokens: int  # prompt tokens minus hit tokens
    prefill_s: float  # predicted prefill seconds
    kv_tokens: int  # prompt + max_tokens, held on the decode instance
    created_s: float
    decode_start_s: float  # predicted (made actual by prefill_done)
    decode_end_s: float  # predicted
    prefill_pending: bool = True
    output_tokens: int = 0  # of kv_tokens, the output (max_tokens): held only as it is generated
    ready_s: float = -1.0  # its KV ready to ship to the decode instance (the prefill's end); < 0: decode_start_s
    admitted_s: float = -1.0  # its first token seen: the decode engine holds its KV; < 0: not yet


@dataclass(slots=True)
class _Observed:
    running: int
    waiting: int
    kv_usage: float
    at_s: float


@dataclass(slots=True)
class _Load:
    """Per-instance counters; ``pending`` keeps prefill arrival order for the head credit."""

    idle_prefill: PrefillState  # the shared answer for the common idle case (no queue, no metrics)
    queued_tokens: int = 0
    queued_s: float = 0.0
    pending: dict[str, float] = field(default_factory=dict)  # request id -> predicted prefill s
    head_since_s: float = 0.0  # when the current head of the prefill queue started
    running: int = 0
    kv_tokens: int = 0
    decoding: dict[str, Reservation] = field(default_factory=dict)
    active: int = 0  # reservations touching this instance, each counted once
    observed: _Observed | None = None
    kv_capacity_tokens: int = 0
    typical_prefill_s: float = 0.0  # for queue seen in metrics but not in the ledger
    decode_now: DecodeState | None = None  # cached (running, kv) view; None when stale
    kv_share: float = 1.0  # device KV per context token the engine holds (learned in ``observe``)


def split_params(policy_params: dict[str, Any]) -> tuple[dict[str, bool], dict[str, Any]]:
    """The ledger's options out of a policy's raw parameters (any policy takes them), and the rest:
    ``decode_fifo`` (the decode wait replayed first come first served; ``off`` keeps the earlier
    sweep) and ``decode_share`` (the TBT of a cache whose sequences share prefix blocks, learned
    from the engines' KV usage; ``off`` counts whole contexts against the capacity), both on by
    default. Keyword arguments of :class:`Ledger`."""
    rest = dict(policy_params)
    return {"fifo_decode": bool(_coerce("decode_fifo", bool, rest.pop("decode_fifo", True))),
            "learn_kv_share": bool(_coerce("decode_share", bool, rest.pop("decode_share", True)))}, rest


def _fifo_kv_wait(d: _Load, need: int, t0: float, now: float) -> float:
    """``decode_kv_wait`` as a decode engine admits: first come first served as KV frees. The
    reservations are replayed in the order their KV is ready, each taking room once everyone before
    it has been admitted and holding its prompt and half its output from then to its predicted end
    (an overdue one ends any moment now); then the new request at ``t0``. Without the replay a
    waiter is counted from its prefill's end and the new request is placed in room earlier waiters
    take first (docs/experiments/live-baselines-synthetic.md)."""
    def ready(r: Reservation) -> float:
        return r.ready_s if r.ready_s >= 0 else r.decode_start_s

    free = float(d.kv_capacity_tokens)
    ends: list[tuple[float, float]] = []  # (end, tokens) of those admitted
    last = -math.inf  # the latest admission so far: nobody behind it goes earlier

    def admit(tokens: float, at: float) -> float:
        nonlocal free, last
        t = at if at > last else last
        while free < tokens and ends:
            end, held = heapq.heappop(ends)
            free += held
            if end > t:
                t = end
        last = t
        return t

    for r in sorted(d.decoding.values(), key=ready):
        at = ready(r)
        if at > t0:
            break  # after the new request: it goes first
        held = r.kv_tokens - r.output_tokens / 2
        t = admit(held, at)
        free -= held
        end = t + (r.decode_end_s - r.decode_start_s)
        heapq.heappush(ends, (end if end > now else now, held))
    return max(0.0, admit(float(need), t0) - now)


def _learn_kv_share(d: _Load, kv_usage: float) -> None:
    """One sample of ``kv_share``: the KV the engine reports in use over the context its admitted
    reservations hold (prompt and half the output each, as the decode wait counts them). An engine
    keeps a prefix that running sequences share once, while each step reads every sequence's whole
    context: on a full cache that is 1 / kv_share more context than the capacity, and a slower step
    (docs/predictors.md, "Shared prefixes on a full decode cache")."""
    cap = d.kv_capacity_tokens
    if cap <= 0:
        return
    held = sum(r.kv_tokens - r.output_tokens / 2 for r in d.decoding.values() if r.admitted_s >= 0)
    if held < KV_SHARE_MIN_HELD * cap:
        return
    sample = kv_usage * cap / held
    sample = KV_SHARE_FLOOR if sample < KV_SHARE_FLOOR else 1.0 if sample > 1.0 else sample
    d.kv_share += KV_SHARE_ALPHA * (sample - d.kv_share)
    d.decode_now = None


class Ledger:
    """Reservations and the per-instance load they add up to; pure, clock passed in."""

    def __init__(self, observe_ttl_s: float = 10.0, fifo_decode: bool = True, learn_kv_share: bool = True):
        self.observe_ttl_s = observe_ttl_s
        # the decode wait as the engine admits waiters: first come first served (``_fifo_kv_wait``)
        self.fifo_decode = fifo_decode
        # each decode instance's kv_share from its reported KV usage (``observe``)
        self.learn_kv_share = learn_kv_share
        self._loads: dict[str, _Load] = {}
        self._reservations: dict[str, Reservation] = {}
        self._load_avg: float | None = None  # decode_load's smoothed reservations per instance
        self._load_at = 0.0

    # --- instances ----------------------------------------------------------------------
    def add_instance(self, instance_id: str, kv_capacity_tokens: int = 0, typical_prefill_s: float = 0.0) -> None:
        if instance_id not in self._loads:
            self._loads[instance_id] = _Load(PrefillState(instance_id), kv_capacity_tokens=kv_capacity_tokens,
                                             typical_prefill_s=typical_prefill_s)

    def set_kv_capacity(self, instance_id: str, kv_capacity_tokens: int) -> None:
        """The instance's device KV capacity in tokens (learned from the engine at run time)."""
        load = self._loads.get(instance_id)
        if load is not None:
            load.kv_capacity_tokens = kv_capacity_tokens
            load.decode_now = None

    def remove_instance(self, instance_id: str) -> None:
        """Stop tracking an instance; reservations on it stay releasable (exactly once)."""
        self._loads.pop(instance_id, None)

    # --- reservations -------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reservations

    def __len__(self) -> int:
        return len(self._reservations)

    def get(self, request_id: str) -> Reservation | None:
        return self._reservations.get(request_id)

    def reserve(self, r: Reservation, now: float) -> bool:
        """Add a reservation; False (and no change) if its request id is already held."""
        if r.request_id in self._reservations:
            return False
        self._reservations[r.request_id] = r
        p = self._loads.get(r.prefill)
        if p is not None:
            if not p.pending:
                p.head_since_s = now
            p.pending[r.request_id] = r.prefill_s
            p.queued_tokens += r.prefill_tokens
            p.queued_s += r.prefill_s
            p.active += 1
        d = self._loads.get(r.decode)
        if d is not None:
            d.running += 1
            d.kv_tokens += r.kv_tokens
            d.decode_now = None
            d.decoding[r.request_id] = r
            if r.decode != r.prefill:
                d.active += 1
        return True

    def prefill_done(self, request_id: str, now: float) -> bool:
        """Its prefill finished: the work leaves the prefill queue. Idempotent; unknown ids ignored."""
        r = self._reservations.get(request_id)
        if r is None or not r.prefill_pending:
            return False
        self._unqueue(r, now)
        duration = r.decode_end_s - r.decode_start_s
        r.decode_start_s, r.decode_end_s = now, now + duration
        r.ready_s = now
        return True

    def decode_started(self, request_id: str, now: float) -> bool:
        """Its first token came: the decode engine admitted it and holds its KV (what ``observe``
        compares the engine's KV usage with). True the first time only."""
        r = self._reservations.get(request_id)
        if r is None or r.admitted_s >= 0:
            return False
        r.admitted_s = now
        return True

    def release(self, request_id: str, now: float) -> bool:
        """Return everything the reservation still holds; True only the first time."""
        r = self._reservations.pop(request_id, None)
        if r is None:
            return False
        if r.prefill_pending:
            self._unqueue(r, now)
        d = self._loads.get(r.decode)
        if d is not None and d.decoding.pop(request_id, None) is not None:
            d.running -= 1
            d.kv_tokens -= r.kv_tokens
            d.decode_now = None
            d.active -= 1
        return True

    def _unqueue(self, r: Reservation, now: float) -> None:
        r.prefill_pending = False
        p = self._loads.get(r.prefill)
        if p is None or r.request_id not in p.pending:
            return
        was_head = next(iter(p.pending)) == r.request_id
        del p.pending[r.request_id]
        p.queued_tokens -= r.prefill_tokens
        if p.pending:
            p.queued_s = max(0.0, p.queued_s - r.prefill_s)
            if was_head:
                p.head_since_s = now  # the next in line starts its turn now
        else:  # exact zero: no float residue survives an empty queue
            p.queued_s = 0.0
        if r.decode != r.prefill:
            p.active -= 1

    # --- load views ---------------------------------------------------------------------
    def prefill_state(self, instance_id: str, now: float) -> PrefillState:
        """Queued prefill work; the head's elapsed time (up to its prediction) is already done."""
        return self.prefill_view(instance_id, now)[0]

    def prefill_view(self, instance_id: str, now: float) -> tuple[PrefillState, int]:
        """``prefill_state`` and the active request count in one lookup."""
        states, active = self.prefill_views((instance_id,), now)
        return states[0], active[0]

    def prefill_views(self, instance_ids: Iterable[str], now: float) -> tuple[list[PrefillState], list[int]]:
        """``prefill_view`` of many instances in one call (the decision's hot loop: no call, no
        ``min``/``max`` builtin per candidate)."""
        loads, ttl = self._loads, self.observe_ttl_s
        states: list[PrefillState] = []
        actives: list[int] = []
        for instance_id in instance_ids:
            p = loads.get(instance_id)
            if p is None:
                states.append(PrefillState(instance_id))
                actives.append(0)
                continue
            pending, o = p.pending, p.observed
            if not pending and o is None:  # the common idle case, no arithmetic
                states.append(p.idle_prefill)
                actives.append(p.active)
                continue
            queued_s = p.queued_s
            requests = len(pending)
            if pending:  # the head's elapsed time, up to its prediction, is already done
                head_s = next(iter(pending.values()))
                elapsed = now - p.head_since_s
                elapsed = elapsed if elapsed > 0.0 else 0.0
                queued_s -= head_s if head_s < elapsed else elapsed
            if o is not None and now - o.at_s <= ttl:
                unseen = o.waiting - requests  # queued in the engine but not placed by us
                if unseen > 0:
                    queued_s += unseen * p.typical_prefill_s
            states.append(_prefill_state(PrefillState, (instance_id, p.queued_tokens,
                                                        queued_s if queued_s > 0.0 else 0.0, requests)))
            actives.append(p.active)
        return states, actives

    def decode_state(self, instance_id: str, now: float) -> DecodeState:
        """Running sequences and KV tokens: the larger of our reservations and observed metrics."""
        return self.decode_states((instance_id,), now)[0]

    def decode_states(self, instance_ids: Iterable[str], now: float) -> list[DecodeState]:
        """``decode_state`` of many instances in one call (a reserved view is kept until it changes)."""
        loads, ttl = self._loads, self.observe_ttl_s
        out: list[DecodeState] = []
        for instance_id in instance_ids:
            d = loads.get(instance_id)
            if d is None:
                out.append(DecodeState(instance_id))
                continue
            o = d.observed
            if o is None:
                s = d.decode_now
                if s is None:
                    s = d.decode_now = DecodeState(instance_id, d.running, d.kv_tokens, d.kv_share)
                out.append(s)
                continue
            running, kv = d.running, d.kv_tokens
            if now - o.at_s <= ttl:
                running = max(running, o.running)
                kv = max(kv, int(o.kv_usage * d.kv_capacity_tokens))
            out.append(DecodeState(instance_id, running, kv, d.kv_share))
        return out

    def decode_state_at(self, instance_id: str, t: float, now: float) -> DecodeState:
        """Predicted decode load at time ``t`` (Mooncake §7.4): those decoding at t, not the rest.

        A reservation counts if its (predicted) decode has started by ``t`` and not yet ended;
        load seen only in observed metrics is assumed to stay.
        """
        d = self._loads.get(instance_id)
        if d is None:
            return DecodeState(instance_id)
        running = kv = 0
        for r in d.decoding.values():
            # still held past its predicted end: it is running late, so assume it still runs at t
            if r.decode_start_s <= t and (t < r.decode_end_s or r.decode_end_s <= now):
                running += 1
                kv += r.kv_tokens
        o = d.observed
        if o is not None and now - o.at_s <= self.observe_ttl_s:  # unplaced load stays
            running += max(0, o.running - d.running)
            kv += max(0, int(o.kv_usage * d.kv_capacity_tokens) - d.kv_tokens)
        return DecodeState(instance_id, running, kv, d.kv_share)

    def decode_kv_wait(self, instance_id: str, need_tokens: int, t0: float, now: float) -> float:
        """Seconds from ``now`` until the decode instance has room for ``need_tokens`` more KV
        tokens, no earlier than ``t0`` (when this request's KV would be ready to ship).

        An engine admits a request only when its prompt's blocks fit (vLLM); until then the
        request waits there, after its prefill, before its first token. KV in use at time t is
        each reservation's prompt plus the output generated so far (linear over its predicted
        decode span) for those whose decode has started by t; room appears as they finish.
        0 when it fits at ``t0``, or when the capacity is unknown.
        """
        d = self._loads.get(instance_id)
        if d is None or d.kv_capacity_tokens <= 0:
            return 0.0
        cap = d.kv_capacity_tokens
        if d.kv_tokens + need_tokens <= cap:  # fits even if everyone held their whole output: the usual case
            return 0.0
        if self.fifo_decode:
            return _fifo_kv_wait(d, need_tokens, t0 if t0 > now else now, now)
        if t0 < now:  # the KV is ready already: what matters is room from now on, not at a past instant
            t0 = now
        # a reservation decoding over [start, end) holds prompt + output x (t - start) / span: a
        # linear piece a + b t; one overdue (end <= now) is assumed to hold its whole KV on. One
        # sweep over the candidate times adds pieces as they start and drops them as they end.
        # Pieces are taken from ``now`` (t - now, not a monotonic clock's 1e6 s) so the sums stay
        # small; a piece steeper than any decode (span ~0) would swamp them (rate x start cancels
        # catastrophically, or overflows to inf/nan), so the few such are evaluated directly.
        joins: list[tuple[float, float, float]] = []
        leaves: list[tuple[float, float, float]] = []
        steep: list[Reservation] = []
        for r in d.decoding.values():
            s, e = r.decode_start_s, r.decode_end_s
            if e <= now:
                joins.append((s, float(r.kv_tokens), 0.0))
            elif e > s:
                if r.output_tokens > _MAX_DECODE_RATE * (e - s):
                    steep.append(r)
                    leaves.append((e, 0.0, 0.0))  # its end is still a candidate time
                    continue
                rate = r.output_tokens / (e - s)
                piece = (r.kv_tokens - r.output_tokens - rate * (s - now), rate)
                joins.append((s, *piece))
                leaves.append((e, *piece))
        joins.sort()
        leaves.sort()
        ends = sorted({t0, *(e for e, _, _ in leaves if e > t0)})
        a = b = 0.0
        i = j = 0
        for t in ends:
            while i < len(joins) and joins[i][0] <= t:
                a, b, i = a + joins[i][1], b + joins[i][2], i + 1
            while j < len(leaves) and leaves[j][0] <= t:
                a, b, j = a - leaves[j][1], b - leaves[j][2], j + 1
            used = a + b * (t - now)
            for r in steep:  # decoding at t: s <= t < e
                if r.decode_start_s <= t < r.decode_end_s:
                    done = (t - r.decode_start_s) / (r.decode_end_s - r.decode_start_s)
                    used += r.kv_tokens - r.output_tokens * (1.0 - (done if done < 1.0 else 1.0))
            if used + need_tokens <= cap:
                return max(0.0, t - now)
        return max(0.0, ends[-1] - now)

    def decode_kv_waits(self, instance_ids: Iterable[str], need_tokens: int, t0: float, now: float) -> list[float]:
        """``decode_kv_wait`` of many instances in one call: 0 at once where the KV fits now."""
        loads = self._loads
        out: list[float] = []
        for instance_id in instance_ids:
            d = loads.get(instance_id)
            if d is None or d.kv_capacity_tokens <= 0 or d.kv_tokens + need_tokens <= d.kv_capacity_tokens:
                out.append(0.0)
            else:
                out.append(self.decode_kv_wait(instance_id, need_tokens, t0, now))
        return out

    def decode_departures(self, instance_id: str) -> list[Reservation]:
        """Reservations decoding on an instance, soonest predicted end first (for retry-after)."""
        d = self._loads.get(instance_id)
        if d is None:
            return []
        return sorted(d.decoding.values(), key=lambda r: r.decode_end_s)

    def observe(self, instance_id: str, running: int, waiting: int, kv_usage: float, now: float) -> bool:
        """Record scraped engine metrics; False for an unknown instance or impossible values."""
        d = self._loads.get(instance_id)
        if d is None:
            return False
        try:
            ok = (0 <= running < 1e9 and 0 <= waiting < 1e9 and 0.0 <= kv_usage <= 1.0
                  and math.isfinite(running) and math.isfinite(waiting))
        except TypeError:
            return False
        if not ok:
            return False
        d.observed = _Observed(int(running), int(waiting), float(kv_usage), now)
        if self.learn_kv_share:
            _learn_kv_share(d, float(kv_usage))
        return True

    def decode_load(self, instances: int, now: float, tau_s: float = DECODE_LOAD_TAU_S) -> float:
        """The cluster's decode load: reservations per decode instance (``instances``), averaged
        over the last ``tau_s`` (an EWMA sampled at each call). Requests arriving together are
        one burst that will decode together: the first of them should not see a lighter cluster
        than the last, so load added in the same instant does not move it (a TBT feature)."""
        level = len(self._reservations) / (instances if instances > 0 else 1)
        avg = self._load_avg
        if avg is None or now < self._load_at:
            avg = level
        elif now > self._load_at:
            avg += (1.0 - math.exp((self._load_at - now) / tau_s)) * (level - avg)
        self._load_avg, self._load_at = avg, now
        return avg

    # --- reporting ----------------------------------------------------------------------
    def instance_totals(self, instance_id: str) -> dict[str, float | int]:
        p = self._loads.get(instance_id) or _Load(PrefillState(instance_id))
        return {"reserved_prefill_tokens": p.queued_tokens, "reserved_prefill_s": p.queued_s,
                "active_requests": p.active, "running": p.running, "kv_tokens": p.kv_tokens, "kv_share": p.kv_share}

    def totals(self) -> dict[str, float | int]:
        loads = self._loads.values()
        return {"reservations": len(self._reservations),
                "reserved_prefill_tokens": sum(p.queued_tokens for p in loads),
                "reserved_prefill_s": sum(p.queued_s for p in loads),
                "running": sum(p.running for p in loads),
                "kv_tokens": sum(p.kv_tokens for p in loads)}

    def is_idle(self) -> bool:
        """True when nothing is reserved and every counter is back to exactly zero."""
        return not self._reservations and all(
            p.queued_tokens == 0 and p.queued_s == 0.0 and not p.pending and p.running == 0
            and p.kv_tokens == 0 and not p.decoding and p.active == 0 for p in self._loads.values())
