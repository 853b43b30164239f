"""A request waiting in the wait room (scheduler/deferral.py), and what one evaluation says about it.

``holdable`` reads an evaluation: placed behind a prefill queue longer than the horizon, refused for
TTFT alone while drained queues meet it, or (``wait_holder``) sent off the holder of its prefix
while that one is busy: a :class:`View` to wait on; None: the room decides at once, as without it.
A :class:`Waiter` keeps its latest view: its cost (the room's order), its last chance, its deadline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from predictors.telemetry import SLO
from scheduler.deferral_params import DeferParams
from scheduler.explain import candidates, cheapest_prefill_s
from scheduler.types import Placement, Rejection, RequestFacts

if TYPE_CHECKING:
    from scheduler.lifecycle import RequestLifecycle

#: refusals a wait can cure: the queue is long now, drained queues would meet the SLO
_TRANSIENT = "ttft_slo"


@dataclass(slots=True)
class Waiter:
    """A request in the room: its whole SLO, and what its latest evaluation said (``update``)."""

    lc: RequestLifecycle
    facts: RequestFacts
    arrived_s: float
    slo: SLO  # the request's whole SLO (configured, with its overrides)
    cost_s: float  # predicted prefill (+ pull) seconds on its cheapest candidate, after cache hits
    floor_s: float  # its best TTFT with every queue drained
    seq: int
    size_s: float = 0.0  # the room's order: its job size (``defer_size``), set by ``update``
    instance: str | None = None  # the prefill instance its last evaluation chose
    due_s: float = math.inf  # its last chance: dispatched then behind the queue it was last evaluated at
    evaluations: int = 1
    evaluated_s: float = -math.inf  # when it was last evaluated (``reeval_s`` spaces a pump's evaluations)
    held_for: str | None = None  # wait_holder: the prefix holder it last waited for rather than go elsewhere
    latest_s: float = math.inf  # the latest start behind the queue it was last evaluated at (inf: refused then)
    hit_tokens: int = 0  # its longest cached prefix anywhere, at its last evaluation

    @property
    def expires_s(self) -> float:
        """When the remaining SLO falls below the drained-queue TTFT (inf without a TTFT SLO)."""
        ttft = self.slo.ttft_s
        return math.inf if ttft is None else self.arrived_s + ttft - self.floor_s

    @property
    def wake_s(self) -> float:
        """When the room must look at it again whatever the queues: its last chance or its deadline."""
        return min(self.due_s, self.expires_s)

    def update(self, v: View) -> None:
        self.cost_s, self.floor_s, self.instance, self.size_s = v.cost_s, v.floor_s, v.instance, v.size_s
        self.hit_tokens = v.hit_tokens
        if v.instead_of is not None:
            self.held_for = v.instance
        ttft = self.slo.ttft_s
        self.latest_s = math.inf if v.ttft_s is None or ttft is None else self.arrived_s + ttft - v.ttft_s
        self.due_s = math.inf if v.ttft_s is None or ttft is None or v.slack_s < 0 \
            else self.latest_s - v.slack_s


@dataclass(slots=True)
class View:
    """What one evaluation says about a request that may wait."""

    cost_s: float
    floor_s: float
    instance: str | None
    ttft_s: float | None  # predicted TTFT behind the queue (None: refused, it does not fit now)
    slack_s: float  # < 0: no last chance
    instead_of: str | None = None  # wait_holder: the instance the policy chose, passed over for ``instance``
    size_s: float = 0.0  # its job size for the room's order (``defer_size``; "prefill": ``cost_s``)
    hit_tokens: int = 0  # the longest prefix any instance holds


def _sized(v: View, record: dict[str, Any], p: DeferParams, scale: tuple[int, int] | None) -> View:
    """``v`` with its job size (``defer_size``). "pools": the prefill seconds over the prefill
    instances plus its decode's KV-seconds (prompt + half its output, held for its output at the
    chosen pair's predicted TBT) over the decode instances' KV, both shares of a pool-second; a
    decode-bound cluster is spent by the second term, a prefill-bound one by the first."""
    v.size_s = v.cost_s
    if p.size == "pools" and scale is not None:
        n_prefill, kv = scale
        out = record.get("max_tokens") or 0
        tbt = (record.get("terms") or {}).get("tbt_s") or 0.0
        held = ((record.get("prompt_tokens") or 0) + out / 2) * out * tbt
        v.size_s = v.cost_s / max(n_prefill, 1) + (held / kv if kv > 0 else 0.0)
    return v


def holdable(d: Placement | Rejection, slo: SLO, p: DeferParams,
             scale: tuple[int, int] | None = None, join: bool = False) -> View | None:
    """What waiting is judged on, when it may help: placed behind a queue longer than the
    horizon, or refused for TTFT alone while drained queues meet it; None: decide now.
    ``scale``: ``Scheduler.pool_scale()``, for the "pools" size. ``join``: a placement that would
    go now waits too (``defer_join``: an arrival joining a room where others wait)."""
    v = _holdable(d, slo, p)
    if v is None and join and isinstance(d, Placement):
        v = _view(d.explanation, d.ttft_s, p.slack * (slo.ttft_s or 0.0) if p.last_chance else -1.0)
    if v is None:
        return v
    v.hit_tokens = int((d.explanation.get("best_holder") or {}).get("hit_tokens") or 0)
    return _sized(v, d.explanation, p, scale)


def _holdable(d: Placement | Rejection, slo: SLO, p: DeferParams) -> View | None:
    slack = p.slack * (slo.ttft_s or 0.0) if p.last_chance else -1.0
    if isinstance(d, Placement):
        if d.queue_s <= p.horizon_s:
            return _wait_for_holder(d, p, slack) if p.wait_holder else None
        return _view(d.explanation, d.ttft_s, slack)
    if d.reason != _TRANSIENT or any(v.get("reason") != _TRANSIENT for v in d.explanation.get("violations", ())):
        return None
    return _view(d.explanation, None, slack)


def _view(record: dict[str, Any], ttft_s: float | None, slack_s: float) -> View:
    """From a decision record: the cheapest candidate's transfer + prefill (the cost), the best TTFT
    with drained queues (plus the chosen pair's KV shipment and first step), the chosen instance."""
    cost = cheapest_prefill_s(record)
    terms = record.get("terms") or {}
    floor = cost + terms.get("kv_transfer_s", 0.0) + terms.get("decode_first_step_s", 0.0)
    return View(cost, floor, (record.get("chosen") or {}).get("prefill"), ttft_s, slack_s)


def _wait_for_holder(d: Placement, p: DeferParams, slack_s: float) -> View | None:
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
    return View(cost, cost + tail, best["id"], best["ttft_s"] + tail, slack_s, instead_of=d.prefill)
