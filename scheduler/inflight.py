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
    """Block hashes placed on prefill instances and not yet confirmed; pure, clock passed in."""

    def __init__(self, grace_s: float = 1.0):
        self.grace_s = grace_s
        self._entries: dict[str, tuple[str, list[int]]] = {}  # request id -> (instance, block hashes)
        self._holders: dict[int, dict[str, int]] = {}  # block hash -> instance -> registrations
        self._done: dict[str, float] = {}  # request id -> when its registration lapses (prefill done)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, instance: str, hashes: list[int]) -> None:
        if request_id in self._entries or not hashes:
            return
        self._entries[request_id] = (instance, hashes)
        holders = self._holders
        for h in hashes:
            by = holders.get(h)
            if by is None:
                holders[h] = {instance: 1}
            else:
                by[instance] = by.get(instance, 0) + 1

    def prefill_done(self, request_id: str, now: float) -> None:
        """The prefill finished: the KV events follow; keep the entry ``grace_s`` longer."""
        if request_id in self._entries:
            self._done[request_id] = now + self.grace_s

    def drop(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        self._done.pop(request_id, None)
        if entry is None:
            return
        instance, hashes = entry
        holders = self._holders
        for h in hashes:
            by = holders.get(h)
            if by is None:
                continue
            n = by.get(instance, 0) - 1
            if n > 0:
                by[instance] = n
            else:
                by.pop(instance, None)
                if not by:
                    del holders[h]

    def expire(self, now: float) -> None:
        """Drop the registrations whose grace ran out."""
        if self._done:
            for rid in [r for r, t in self._done.items() if t <= now]:
                self.drop(rid)

    def match(self, hashes: list[int], limit: int) -> dict[str, int]:
        """Longest contiguous prefix (blocks) each instance has registered for ``hashes[:limit]``."""
        holders = self._holders
        if not holders or limit <= 0:
            return {}
        out: dict[str, int] = {}
        first = holders.get(hashes[0])
        if not first:
            return out
        alive = set(first)
        for i in range(1, min(limit, len(hashes))):
            by = holders.get(hashes[i])
            ended = alive.difference(by) if by else alive
            for inst in ended:
                out[inst] = i
            if by is None:
                return out
            alive.intersection_update(by)
            if not alive:
                return out
        n = min(limit, len(hashes))
        for inst in alive:
            out[inst] = n
        return out
