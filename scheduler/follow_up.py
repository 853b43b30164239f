"""Follow-up load: the prefill work each prefill instance receives because it holds a prefix.

A conversation lives where its first turn was prefilled: its follow-ups hit that instance's cache
and go there. Algorithm 1 places a turn with a new prefix greedily, on this request's TTFT alone,
although an instance that already holds many active conversations will soon receive their
follow-ups, and the new conversation's follow-ups will queue behind them. The recent rate of
affinity-bound work placed on an instance (requests whose prefix it held) estimates that load:
per instance, the prefill seconds of such placements, exponentially decayed with time constant
``tau_s`` (the value is then about the bound work expected over the next ``tau_s`` if the rate
holds). Pure: the clock is passed in.
"""
from __future__ import annotations

import math


class FollowUpLoad:
    """Per prefill instance, an exponentially decayed sum of affinity-bound prefill seconds."""

    def __init__(self, tau_s: float):
        if not tau_s > 0:
            raise ValueError("tau_s must be > 0")
        self.tau_s = tau_s
        self._sum: dict[str, tuple[float, float]] = {}  # instance -> (decayed sum, when it was decayed to)

    def add(self, instance: str, work_s: float, now: float) -> None:
        """A request bound to ``instance`` by its prefix was placed there, adding ``work_s``."""
        self._sum[instance] = (self.value(instance, now) + work_s, now)

    def value(self, instance: str, now: float) -> float:
        """The decayed sum at ``now`` (0 for an instance never bound to); never decays backwards."""
        entry = self._sum.get(instance)
        if entry is None:
            return 0.0
        s, t = entry
        return s * math.exp(-(now - t) / self.tau_s) if now > t else s

    def snapshot(self, now: float) -> dict[str, float]:
        return {k: self.value(k, now) for k in self._sum}
