"""Prefixes on their way into a prefill instance's cache: placed there, not yet announced by KV
events (which arrive only after the prefill, plus the event lag).

A burst of requests sharing a new prefix would otherwise look cold everywhere and scatter; the
engine serves them FIFO, so a follower queued behind the first request on the same instance
finds the prefix cached when its turn comes. SGLang's router gets this by recording prefixes at
routing time, Dynamo by tracking in-flight blocks per worker. Here the scheduler registers the
prompt's complete blocks when it places a request; the entry ends when the request is released
(failed, aborted, finished) or ``grace_s`` after its prefill finished — by then the instance's KV
events have reconciled the hit index, which is the truth from there on (an eviction it reports is
not masked by a stale registration).
"""
from __future__ import annotations


class InflightPrefixes:
    """Block hashes placed on prefill instances and not yet confirmed; pure, clock passed in.

    Per instance, each registered request's blocks as one frozenset: registering and dropping
    cost one set build and one dict operation (this runs on every placement), a lookup probes
    the instance's few in-flight sets.
    """

    def __init__(self, grace_s: float = 1.0):
        self.grace_s = grace_s
        self._instance: dict[str, str] = {}  # request id -> instance
        self._sets: dict[str, dict[str, frozenset[int]]] = {}  # instance -> request id -> its blocks
        self._done: dict[str, float] = {}  # request id -> when its registration lapses (prefill done)

    def __len__(self) -> int:
        return len(self._instance)

    def add(self, request_id: str, instance: str, hashes: list[int]) -> None:
        if request_id in self._instance or not hashes:
            return
        self._instance[request_id] = instance
        self._sets.setdefault(instance, {})[request_id] = frozenset(hashes)

    def prefill_done(self, request_id: str, now: float) -> None:
        """The prefill finished: the KV events follow; keep the entry ``grace_s`` longer."""
        if request_id in self._instance:
            self._done[request_id] = now + self.grace_s

    def drop(self, request_id: str) -> None:
        instance = self._instance.pop(request_id, None)
        self._done.pop(request_id, None)
        if instance is None:
            return
        sets = self._sets[instance]
        del sets[request_id]
        if not sets:
            del self._sets[instance]

    def expire(self, now: float) -> None:
        """Drop the registrations whose grace ran out."""
        if self._done:
            for rid in [r for r, t in self._done.items() if t <= now]:
                self.drop(rid)

    def match(self, hashes: list[int], limit: int) -> dict[str, int]:
        """Longest contiguous prefix (blocks) each instance has registered for ``hashes[:limit]``.

        A block hash names its whole prefix (chained), so a registration holding block k holds
        blocks 0..k too: what an instance has registered of ``hashes`` is a prefix of it, and
        its end is found by bisection, a few probes rather than one per block."""
        n = min(limit, len(hashes))
        if not self._sets or n <= 0:
            return {}
        out: dict[str, int] = {}
        first = hashes[0]
        for inst, by_request in self._sets.items():
            sets = [s for s in by_request.values() if first in s]
            if not sets:
                continue
            lo, hi = 1, n  # blocks [0, lo) registered; the answer is in [lo, hi]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                h = hashes[mid - 1]
                if any(h in s for s in sets):
                    lo = mid
                else:
                    hi = mid - 1
            out[inst] = lo
        return out
