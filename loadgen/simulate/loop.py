"""Virtual time: a heap of timed callbacks run in (time, insertion) order.

Nothing sleeps; ``now`` jumps from one event to the next, so an hour of trace runs as fast as
its events can be processed. Ties run in the order they were scheduled, which keeps a run
deterministic for one seed.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable


class EventLoop:
    __slots__ = ("now", "_queue", "_order", "events")

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.events = 0  # callbacks run so far

    def clock(self) -> float:
        """The injected clock of everything simulated (scheduler, lifecycles)."""
        return self.now

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (never before now)."""
        heapq.heappush(self._queue, (t if t > self.now else self.now, next(self._order), fn, args))

    def pending(self) -> int:
        return len(self._queue)

    def run(self, until: float | None = None, on_tick: Callable[[], None] | None = None,
            tick_every: int = 20_000) -> None:
        """Run events until none is left (or the next is after ``until``); ``on_tick`` every
        ``tick_every`` events (progress reporting)."""
        q, pop = self._queue, heapq.heappop
        horizon = float("inf") if until is None else until
        tick = tick_every if on_tick is not None else -1  # counts down to the next on_tick
        while q:
            if q[0][0] > horizon:
                break
            t, _, fn, args = pop(q)
            self.now = t
            fn(*args)
            self.events += 1
            tick -= 1
            if not tick:
                tick = tick_every
                if on_tick is not None:
                    on_tick()
