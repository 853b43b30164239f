"""Per-key quotas: request and token rates (token buckets) and a cap on requests in flight.

Pure, clock injected (no I/O, no awaits), so a test drives time by hand. A refusal says how long
until the bucket holds enough again: the client's ``Retry-After`` comes from the bucket, not a
guess. Tokens are charged at admission as ``prompt + max_tokens``, the most a request may use
(as OpenAI counts ``max_tokens`` against a token-per-minute limit), and given back when no engine
worked on the request (refused over the SLO, a bad request, nothing healthy).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


class TokenBucket:
    """``rate`` units a second refill up to ``capacity``; starts full."""

    __slots__ = ("rate", "capacity", "level", "stamp")

    def __init__(self, rate: float, capacity: float, now: float):
        self.rate, self.capacity, self.level, self.stamp = rate, capacity, capacity, now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` units are available (0: now; inf: never, more than the capacity)."""
        self._refill(now)
        if cost <= self.level:
            return 0.0
        if cost > self.capacity:
            return math.inf
        return (cost - self.level) / self.rate

    def take(self, cost: float, now: float) -> None:
        self._refill(now)
        self.level -= cost

    def give_back(self, cost: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + cost)


@dataclass(frozen=True, slots=True)
class Limits:
    """One key's limits; None: unlimited. Bursts default to one minute's worth."""

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    request_burst: float | None = None
    token_burst: float | None = None
    max_concurrent: int | None = None

    def limited(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent))


@dataclass(frozen=True, slots=True)
class Refusal:
    """A quota said no: ``retry_after_s`` None when waiting cannot help (bigger than the burst)."""

    message: str
    retry_after_s: float | None
    limit: str  # "requests" | "tokens" | "concurrency"


class Quotas:
    """Buckets and in-flight counts per key name (names from the config only: bounded)."""

    def __init__(self, limits: dict[str, Limits], clock: Callable[[], float]):
        self.clock = clock
        self.limits = {k: v for k, v in limits.items() if v.limited()}
        now = clock()
        self._requests = {k: TokenBucket(v.requests_per_minute / 60.0, v.request_burst or v.requests_per_minute, now)
                          for k, v in self.limits.items() if v.requests_per_minute is not None}
        self._tokens = {k: TokenBucket(v.tokens_per_minute / 60.0, v.token_burst or v.tokens_per_minute, now)
                        for k, v in self.limits.items() if v.tokens_per_minute is not None}
        self.in_flight: dict[str, int] = {k: 0 for k in self.limits}
        self._holders: dict[str, str] = {}  # request id -> key holding a concurrency slot
        self._charged: dict[str, tuple[str, int]] = {}  # request id -> (key, tokens charged)

    def arrive(self, key: str, request_id: str) -> Refusal | None:
        """A request of ``key`` arrives: take a request token and a concurrency slot, or refuse
        (taking nothing). The slot is held until :meth:`release`."""
        lim = self.limits.get(key)
        if lim is None:
            return None
        if lim.max_concurrent is not None and self.in_flight[key] >= lim.max_concurrent:
            return Refusal(f"API key {key!r} has {lim.max_concurrent} requests in flight, its limit",
                           1.0, "concurrency")
        bucket, now = self._requests.get(key), self.clock()
        if bucket is not None:
            wait = bucket.wait_s(1.0, now)
            if wait > 0:
                return Refusal(f"API key {key!r} is over its limit of {lim.requests_per_minute:g} requests a minute",
                               wait, "requests")
            bucket.take(1.0, now)
        self.in_flight[key] += 1
        self._holders[request_id] = key
        return None

    def charge_tokens(self, key: str, tokens: int, request_id: str = "") -> Refusal | None:
        """Charge ``tokens`` (prompt + max_tokens) to the key's token bucket, or refuse."""
        bucket = self._tokens.get(key)
        if bucket is None:
            return None
        now = self.clock()
        wait = bucket.wait_s(tokens, now)
        if wait == math.inf:
            return Refusal(f"the request may use {tokens} tokens (prompt + max_tokens): more than API key {key!r} "
                           f"may use at once ({bucket.capacity:g}); lower max_tokens or shorten the prompt",
                           None, "tokens")
        if wait > 0:
            return Refusal(f"API key {key!r} is over its limit of {self.limits[key].tokens_per_minute:g} tokens "
                           f"a minute", wait, "tokens")
        bucket.take(tokens, now)
        if request_id:
            self._charged[request_id] = (key, tokens)
        return None

    def release(self, request_id: str, refund: bool = False) -> None:
        """The request finished: its concurrency slot is free, and with ``refund`` (no engine
        worked on it) its tokens go back to the bucket. Idempotent."""
        key = self._holders.pop(request_id, None)
        if key is not None:
            self.in_flight[key] -= 1
        charged = self._charged.pop(request_id, None)
        if charged is not None and refund:
            self._tokens[charged[0]].give_back(charged[1], self.clock())
