"""Online quantile tracking of the served p90 (adaptive conformal inference, Gibbs & Candès 2021;
quantile tracking, Angelopoulos, Candès & Tibshirani 2023).

A static conformal scale covers q of the rows it was calibrated on, but drift within a run moves
the coverage of one stretch by several points either way (8B gap telemetry: TBT 86-98% over the
fifths of a run). The tracker keeps a multiplicative scale per key on the calibrated upper
quantile and, at each outcome, steps its log by ``eta * (miss - (1 - q))``: up on a miss, down on
a cover. The log-scale stays bounded, so the running mean of ``miss - (1 - q)`` goes to 0 as
1/n: the long-run miss rate tends to 1 - q whatever the drift. Serving pays one multiply per
prediction; an update is one ``exp`` per observed outcome.

:func:`replay` is the same tracker over telemetry rows, in decision order, each outcome applied
only once it would have been known (``conductor calibrate``'s held-out "served" coverage);
:func:`tune_eta` picks ``eta`` on training rows only.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from typing import Any, Sequence

import numpy as np

#: The step when no calibration chose one (log-scale units per observation).
DEFAULT_ETA = 0.05
#: Steps :func:`tune_eta` tries (0: the static scale).
ETA_GRID = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1)
#: Bound on |log scale|: a tracker never moves the calibrated quantile by more than 4x either way.
LOG_BOUND = math.log(4.0)


class QuantileTracker:
    """Per-key multiplicative scale on an upper quantile, its recent history, and the live
    coverage it has seen.

    An outcome is judged against the quantile as it was served at its request's decision (the
    scale in effect then, from the history): judging it against today's scale instead lets the
    feedback delay hide misses (a burst's requests are decided before any of their outcomes
    arrive) and the served coverage fell to 83% on the 8B gap telemetry's TBT."""

    __slots__ = ("q", "eta", "log_scale", "scale", "n", "covered", "_times", "_logs")

    #: Updates of history kept per key (a decision older than all of them reads the oldest).
    HISTORY = 8192

    def __init__(self, q: float = 0.9, eta: float = DEFAULT_ETA):
        if not (0.0 < q < 1.0 and math.isfinite(eta) and eta >= 0.0):
            raise ValueError(f"quantile tracker needs 0 < q < 1 and eta >= 0, got q={q}, eta={eta}")
        self.q, self.eta = q, eta
        self.log_scale: dict[str, float] = {}
        self.scale: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.covered: dict[str, int] = {}
        self._times: dict[str, list[float]] = {}  # when each update happened, nondecreasing
        self._logs: dict[str, list[float]] = {}  # the log scale from then on

    def get(self, key: str) -> float:
        """The scale to multiply the calibrated upper quantile by now (1 before any outcome)."""
        return self.scale.get(key, 1.0)

    def at(self, key: str, t: float) -> float:
        """The log scale in effect just before time ``t`` (0 before any update)."""
        times = self._times.get(key)
        if not times:
            return 0.0
        i = bisect_left(times, t)
        return self._logs[key][i - 1] if i > 0 else (0.0 if len(times) < self.HISTORY // 2 else self._logs[key][0])

    def update(self, key: str, actual: float, upper: float, decided: float, now: float) -> None:
        """One outcome: ``upper`` is the calibrated (unscaled) quantile for it, ``decided`` when its
        request was decided, ``now`` when the outcome is known (nondecreasing across calls).
        Non-finite or non-positive input is ignored."""
        if not (actual > 0.0 and upper > 0.0 and math.isfinite(actual) and math.isfinite(upper)):
            return
        hit = actual <= upper * math.exp(self.at(key, decided))
        self.n[key] = self.n.get(key, 0) + 1
        self.covered[key] = self.covered.get(key, 0) + hit
        if self.eta > 0.0:
            ls = self.log_scale.get(key, 0.0) + self.eta * ((0.0 if hit else 1.0) - (1.0 - self.q))
            ls = LOG_BOUND if ls > LOG_BOUND else (-LOG_BOUND if ls < -LOG_BOUND else ls)
            self.log_scale[key] = ls
            self.scale[key] = math.exp(ls)
            times, logs = self._times.setdefault(key, []), self._logs.setdefault(key, [])
            if times and now < times[-1]:
                now = times[-1]
            times.append(now)
            logs.append(ls)
            if len(times) > self.HISTORY:
                del times[: self.HISTORY // 2], logs[: self.HISTORY // 2]

    def coverage(self, key: str) -> float | None:
        """Share of the outcomes seen whose served quantile (at their decision) covered them."""
        n = self.n.get(key, 0)
        return self.covered.get(key, 0) / n if n else None

    def status(self, key: str) -> dict[str, Any]:
        c = self.coverage(key)
        return {"p90_scale": round(self.get(key), 4), "p90_observations": self.n.get(key, 0),
                "p90_live_coverage": None if c is None else round(c, 4)}


def replay(run: Sequence[str], decided: np.ndarray, known: np.ndarray, key: Sequence[str], actual: np.ndarray,
           upper: np.ndarray, q: float, eta: float) -> np.ndarray:
    """The upper quantile each row was served: its calibrated ``upper`` times its key's scale at
    its decision. Each run starts from scale 1 (a gateway loading the models); an outcome updates
    the tracker only once known (``known`` strictly before a later row's ``decided``), in the
    order outcomes become known, exactly as the serving path's observer sees them."""
    n = len(actual)
    served = np.array(upper, dtype=float, copy=True)
    if n == 0 or eta <= 0.0:
        return served
    by_run: dict[str, list[int]] = {}
    for i, r in enumerate(run):
        by_run.setdefault(r, []).append(i)
    for idx in by_run.values():
        tracker = QuantileTracker(q, eta)
        decisions = sorted(idx, key=lambda i: (decided[i], i))
        outcomes = sorted(idx, key=lambda i: (known[i], i))
        k = 0
        for i in decisions:
            while k < len(outcomes) and known[outcomes[k]] < decided[i]:
                j = outcomes[k]
                tracker.update(key[j], float(actual[j]), float(upper[j]), float(decided[j]), float(known[j]))
                k += 1
            served[i] = upper[i] * tracker.get(key[i])
    return served


def block_error(run: Sequence[str], decided: np.ndarray, actual: np.ndarray, served: np.ndarray, q: float,
                blocks: int) -> float:
    """Root mean square over ``blocks`` contiguous stretches of each run (by decision time) of
    their coverage minus ``q``: how far a stretch the size of a hold-out strays from the target."""
    errs: list[float] = []
    by_run: dict[str, list[int]] = {}
    for i, r in enumerate(run):
        by_run.setdefault(r, []).append(i)
    for idx in by_run.values():
        order = sorted(idx, key=lambda i: decided[i])
        for part in np.array_split(np.array(order, dtype=int), max(1, blocks)):
            if len(part):
                errs.append(float(np.mean(actual[part] <= served[part])) - q)
    return math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else 0.0


def tune_eta(streams: Sequence[tuple[Sequence[str], np.ndarray, np.ndarray, Sequence[str], np.ndarray, np.ndarray]],
             q: float, blocks: int = 4, grid: Sequence[float] = ETA_GRID) -> tuple[float, dict[float, float]]:
    """The step whose replay on these (training) streams keeps every stretch of ``1/blocks`` of
    a run closest to ``q`` (mean over the streams of :func:`block_error`); a smaller step wins
    within 0.002 (the tracker adds noise to the quantile). A stream is (run, decided, known, key,
    actual, upper) of one term. Returns the step and each step's error."""
    errors: dict[float, float] = {}
    for eta in grid:
        e = [block_error(s[0], s[1], s[4], replay(*s, q=q, eta=eta), q, blocks) for s in streams if len(s[4])]
        errors[eta] = float(np.mean(e)) if e else 0.0
    best = min(errors.values())
    return min(eta for eta, e in errors.items() if e <= best + 0.002), errors
