"""Overload admission by cost: under overload, admit the cheapest prefills first (issue 15).

Goodput counts requests that meet the SLO. Past capacity, plain SLO admission admits whatever
arrives while a queue happens to be short: a long prompt then holds that prefill instance for
seconds, and the short requests arriving behind it are refused. Mooncake's overload-oriented
scheduling is what this departs from plain admission for; the rule here is a shortest-job-first
knapsack over recent demand:

* every request that reaches admission adds its predicted prefill cost (seconds of prefill on
  its cheapest candidate, after cache hits) to a sliding window of ``window_s`` seconds of
  decision time; a request no candidate could prefill within the TTFT SLO is not demand (it is
  refused as unreachable anyway);
* the window's capacity is the prefill the healthy instances do over it: ``eta`` x instances x
  ``window_s``; before a whole window has passed since the first arrival, over the time since
  then but at least the TTFT SLO (queues may absorb that much of a burst). Demand beyond it (at
  ``eta`` = 1) arrives faster than the instances prefill: that is overload. While the window's
  demand fits, the threshold is infinite and nothing changes;
* past it, the threshold ``tau`` is the largest cost such that all window costs <= tau sum to
  at most the capacity: the requests that fit if the cheapest are served first. A request
  costing more is refused (429 ``overloaded_cost``); the rest still face the SLO check.

Without a TTFT SLO there is no deadline, hence no overload: nothing is refused. The price is
fairness: under overload long prompts are refused first (docs/experiments/overload-admission.md
reports attainment by prompt length). Pure: the clock is passed in.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from scheduler.admission import Verdict, retry_seconds
from scheduler.policies.base import _coerce  # the same parsing as every policy parameter

#: policy parameters the scheduler takes for itself (any policy accepts them) -> field name
PARAM_KEYS = {"cost_admission": "enabled", "cost_eta": "eta", "cost_window_s": "window_s"}


@dataclass(frozen=True)
class OverloadParams:
    enabled: bool = False
    # tuned on the training slices (docs/experiments/overload-admission.md). eta > 1: refusing by
    # cost only the demand past 1.25x capacity did best; below that the SLO check alone decides
    eta: float = 1.25  # share of the window's prefill capacity the admitted demand may take
    window_s: float = 30.0  # decision time over which demand is measured

    def __post_init__(self) -> None:
        if not (isinstance(self.eta, (int, float)) and math.isfinite(self.eta) and self.eta > 0):
            raise ValueError(f"cost_eta must be a positive number, got {self.eta!r}")
        if not (isinstance(self.window_s, (int, float)) and math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"cost_window_s must be a positive number of seconds, got {self.window_s!r}")


def split_params(policy_params: dict[str, Any], default_on: bool) -> tuple[OverloadParams, dict[str, Any]]:
    """The overload parameters out of a policy's raw parameters (TOML natives or ``--policy-param``
    strings), and the rest for the policy. ``default_on``: the policy's own default."""
    rest = dict(policy_params)
    kw: dict[str, Any] = {"enabled": default_on}
    for key, name in PARAM_KEYS.items():
        if key in rest:
            kw[name] = _coerce(key, bool if name == "enabled" else float, rest.pop(key))
    return OverloadParams(**kw), rest


class CostWindow:
    """Arrivals' predicted prefill costs over the last ``window_s`` seconds; the SJF threshold."""

    def __init__(self, params: OverloadParams):
        self.params = params
        self._arrivals: deque[tuple[float, float, str]] = deque()  # (time, cost, request id), oldest first
        self._ids: set[str] = set()  # requests counted in the window (a retry is not new demand)
        self._sorted: list[float] = []  # the same costs, ascending
        self._total = 0.0
        self._first: float | None = None  # the first arrival: before a whole window, capacity is over less
        self._now = 0.0

    def __len__(self) -> int:
        return len(self._arrivals)

    @property
    def demand_s(self) -> float:
        return self._total

    def capacity_s(self, instances: int, slack_s: float, at: float | None = None) -> float:
        """Prefill seconds ``instances`` do over the window at ``at`` (default: the last time seen)
        x eta; while the window is not yet full, over the time since the first arrival, but at
        least ``slack_s`` (the TTFT SLO)."""
        at = self._now if at is None else at
        w = self.params.window_s
        span = w if self._first is None else min(w, max(at - self._first, slack_s))
        return self.params.eta * instances * span

    def expire(self, now: float) -> None:
        self._now = max(self._now, now)
        cutoff = now - self.params.window_s
        arrivals, costs = self._arrivals, self._sorted
        while arrivals and arrivals[0][0] <= cutoff:
            _, c, rid = arrivals.popleft()
            self._ids.discard(rid)
            del costs[bisect.bisect_left(costs, c)]
            self._total -= c
        if not arrivals:
            self._total = 0.0  # no drift left behind by the subtractions
        self._total = max(self._total, 0.0)

    def add(self, now: float, cost: float, request_id: str = "") -> None:
        self.expire(now)
        if self._first is None:
            self._first = now
        if request_id:
            self._ids.add(request_id)
        self._arrivals.append((now, cost, request_id))
        bisect.insort(self._sorted, cost)
        self._total += cost

    def threshold(self, instances: int, slack_s: float) -> float:
        """The largest cost admitted: infinite while the window's demand fits its capacity."""
        budget = self.capacity_s(instances, slack_s)
        if self._total <= budget:
            return math.inf
        fit = bisect.bisect_right(list(itertools.accumulate(self._sorted)), budget)
        return self._sorted[fit - 1] if fit else 0.0

    def drain_s(self, now: float, instances: int, slack_s: float) -> float:
        """With no new arrival, seconds until the window's demand fits its capacity again."""
        total = self._total
        if total <= self.capacity_s(instances, slack_s, now):
            return 0.0
        for t, c, _ in self._arrivals:
            total -= c
            gone = t + self.params.window_s  # this arrival leaves the window
            if total <= self.capacity_s(instances, slack_s, gone):
                return max(0.0, gone - now)
        return 0.0

    def check(self, request_id: str, cost: float, now: float, instances: int, slo_ttft_s: float | None,
              record: bool) -> tuple[Verdict | None, dict[str, Any]]:
        """Count the request as demand (when ``record``, once per request id) and judge it; the
        verdict (None: within the threshold) and what the decision record shows."""
        if slo_ttft_s is None or cost > slo_ttft_s:  # no deadline, or unreachable (the SLO check refuses it)
            self.expire(now)
            return None, self._explain(cost, math.inf, instances, 0.0 if slo_ttft_s is None else slo_ttft_s,
                                       counted=False)
        counted = request_id in self._ids
        if not counted:
            self.add(now, cost, request_id if record else "")  # judged as part of the demand it joins
        else:
            self.expire(now)
        tau = self.threshold(instances, slo_ttft_s)
        info = self._explain(cost, tau, instances, slo_ttft_s, counted=record or counted)
        if not (record or counted):  # evaluate(): the window stays as it was
            self._remove_last()
        if cost <= tau:
            return None, info
        p = self.params
        msg = (f"overloaded: predicted prefill {cost:.3f}s exceeds the {tau:.3f}s admitted under overload; "
               f"requests in the last {p.window_s:g}s ask {info['demand_s']:.1f}s of prefill, more than the "
               f"{info['capacity_s']:.1f}s {instances} prefill instances do in that time (x eta {p.eta:g}), "
               f"so the cheapest are admitted first")
        return Verdict("overloaded_cost", msg, retry_seconds(self.drain_s(now, instances, slo_ttft_s))), info

    def _remove_last(self) -> None:
        _, c, _ = self._arrivals.pop()
        del self._sorted[bisect.bisect_left(self._sorted, c)]
        self._total -= c

    def _explain(self, cost: float, tau: float, instances: int, slack_s: float, counted: bool) -> dict[str, Any]:
        return {"cost_s": cost, "threshold_s": None if math.isinf(tau) else tau, "demand_s": self._total,
                "capacity_s": self.capacity_s(instances, slack_s), "window_s": self.params.window_s,
                "eta": self.params.eta, "counted": counted}
