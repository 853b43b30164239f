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

from collections import Counter


class InflightPrefixes:
    """Block hashes placed on prefill instances and not yet confirmed; pure, clock passed in.

    Registrations are filed under their first block's hash and their instance, as a count of each
    block hash they hold. A block hash names its whole prefix (chained: a hash is one position of
    one chain), so only registrations starting with a prompt's first block can hold any of it (a
    lookup reads that one entry, not every instance's registrations), and an instance holds the
    prompt's block k exactly when one of them holds its hash: one dict probe, however many
    requests share the first block. (A conversation trace put hundreds in flight behind one system
    prompt, and asking each of them took ~0.4 ms a lookup; bench/inflight_match.py.) Registering
    counts the prompt's blocks: microseconds on every placement.
    """

    def __init__(self, grace_s: float = 1.0):
        self.grace_s = grace_s
        self._where: dict[str, tuple[str, tuple[int, ...]]] = {}  # request id -> (instance, its blocks)
        # first block hash -> instance -> block hash -> registrations holding it
        self._by_first: dict[int, dict[str, Counter[int]]] = {}
        self._done: dict[str, float] = {}  # request id -> when its registration lapses (prefill done)

    def __len__(self) -> int:
        return len(self._where)

    def add(self, request_id: str, instance: str, hashes: list[int]) -> None:
        if request_id in self._where or not hashes:
            return
        blocks = tuple(hashes)
        self._where[request_id] = (instance, blocks)
        self._by_first.setdefault(blocks[0], {}).setdefault(instance, Counter()).update(blocks)

    def prefill_done(self, request_id: str, now: float) -> None:
        """The prefill finished: the KV events follow; keep the entry ``grace_s`` longer."""
        if request_id in self._where:
            self._done[request_id] = now + self.grace_s

    def drop(self, request_id: str) -> None:
        where = self._where.pop(request_id, None)
        self._done.pop(request_id, None)
        if where is None:
            return
        instance, blocks = where
        by_instance = self._by_first[blocks[0]]
        held = by_instance[instance]
        for h in blocks:
            left = held[h] - 1
            if left:
                held[h] = left
            else:
                del held[h]
        if not held:
            del by_instance[instance]
            if not by_instance:
                del self._by_first[blocks[0]]

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
        for inst, held in by_instance.items():
            lo, hi = 1, n  # blocks [0, lo) registered; the answer is in [lo, hi]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid - 1] in held:
                    lo = mid
                else:
                    hi = mid - 1
            out[inst] = lo
        return out
