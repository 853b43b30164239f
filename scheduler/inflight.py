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

    Each registered request's blocks are one tuple of its block hashes, filed under its first
    block's hash and its instance. A block hash names its whole prefix (chained): only
    registrations starting with a prompt's first block can hold any of it (a lookup reads that
    one entry, not every instance's registrations), and one holds the prompt's block k exactly
    when its own block k has the same hash (a position compare, no set of hashes to build:
    registering costs a tuple and a few dict operations, on every placement).
    """

    def __init__(self, grace_s: float = 1.0):
        self.grace_s = grace_s
        self._where: dict[str, tuple[int, str]] = {}  # request id -> (its first block hash, instance)
        # first block hash -> instance -> request id -> its blocks
        self._by_first: dict[int, dict[str, dict[str, tuple[int, ...]]]] = {}
        self._done: dict[str, float] = {}  # request id -> when its registration lapses (prefill done)

    def __len__(self) -> int:
        return len(self._where)

    def add(self, request_id: str, instance: str, hashes: list[int]) -> None:
        if request_id in self._where or not hashes:
            return
        first = hashes[0]
        self._where[request_id] = (first, instance)
        self._by_first.setdefault(first, {}).setdefault(instance, {})[request_id] = tuple(hashes)

    def prefill_done(self, request_id: str, now: float) -> None:
        """The prefill finished: the KV events follow; keep the entry ``grace_s`` longer."""
        if request_id in self._where:
            self._done[request_id] = now + self.grace_s

    def drop(self, request_id: str) -> None:
        where = self._where.pop(request_id, None)
        self._done.pop(request_id, None)
        if where is None:
            return
        first, instance = where
        by_instance = self._by_first[first]
        registered = by_instance[instance]
        del registered[request_id]
        if not registered:
            del by_instance[instance]
            if not by_instance:
                del self._by_first[first]

    def expire(self, now: float) -> None:
        """Drop the registrations whose grace ran out."""
        if self._done:
            for rid in [r for r, t in self._done.items() if t <= now]:
                self.drop(rid)

    def match(self, hashes: list[int], limit: int) -> dict[str, int]:
        """Longest contiguous prefix (blocks) each instance has registered for ``hashes[:limit]``.

        A registration holding block k holds blocks 0..k too: what an instance has registered
        of ``hashes`` is a prefix of it, and its end is found by bisection, a few probes rather
        than one per block."""
        n = min(limit, len(hashes))
        if not self._by_first or n <= 0:
            return {}
        by_instance = self._by_first.get(hashes[0])
        if by_instance is None:
            return {}
        out: dict[str, int] = {}
        for inst, by_request in by_instance.items():
            chains = list(by_request.values())
            lo, hi = 1, n  # blocks [0, lo) registered; the answer is in [lo, hi]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                k, h = mid - 1, hashes[mid - 1]
                if any(len(c) > k and c[k] == h for c in chains):
                    lo = mid
                else:
                    hi = mid - 1
            out[inst] = lo
        return out
