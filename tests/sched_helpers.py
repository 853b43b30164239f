"""Small helpers shared by the scheduler tests."""
from __future__ import annotations

from typing import Any

from scheduler.deferral_params import room_defaults
from scheduler.policies.conductor import WAIT_ROOM


class Clock:
    """A settable clock for the scheduler's injected ``clock()``."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def toks(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids; different seeds give different blocks."""
    return [(seed * 7919 + k * 31) % 50_000 for k in range(n)]


def plain_room(**params: Any) -> dict[str, Any]:
    """The wait room's own defaults (``DeferParams()``) spelled out as policy parameters, with
    ``params`` over them: the room's mechanics are tested from these, not from the setting conductor
    runs with by default (scheduler/policies/conductor.py ``WAIT_ROOM``)."""
    return {**room_defaults(WAIT_ROOM), "defer": True, **params}
