"""One simulated engine in virtual time: the sim engine's ``EngineModel``, unchanged, stepped
the way its real-time driver steps it (engines_adapters/sim/driver.py).

A step is computed when it starts and its outcome (tokens, finished requests, KV events) is
delivered when it ends; the next step starts at that end if there is work, otherwise the engine
sleeps until new work arrives or its next timer (a KV load completing, held KV expiring).
Requests that arrive during a step join the next one, as on the live server.
"""
from __future__ import annotations

from typing import Callable

from engines_adapters.sim.model import EngineModel, SimRequest, StepResult

from .loop import EventLoop


class SimInstance:
    __slots__ = ("id", "role", "model", "loop", "on_step", "busy", "_scheduled", "_timer_at", "steps", "busy_s")

    def __init__(self, instance_id: str, role: str, model: EngineModel, loop: EventLoop,
                 on_step: Callable[["SimInstance", StepResult], None]):
        self.id, self.role, self.model, self.loop, self.on_step = instance_id, role, model, loop, on_step
        self.busy = False  # a step is running (its outcome is due at its end)
        self._scheduled = False  # a step start is queued at the current time
        self._timer_at: float | None = None  # a wake-up queued for the model's next timer
        self.steps = 0
        self.busy_s = 0.0

    def add(self, req: SimRequest) -> None:
        """Queue a request now; ValueError (from the model) if it can never run."""
        self.model.add_request(req, self.loop.now)
        self.kick()

    def kick(self) -> None:
        """Start a step now unless one is running or already queued."""
        if not self.busy and not self._scheduled:
            self._scheduled = True
            self.loop.at(self.loop.now, self._start)

    def _start(self) -> None:
        self._scheduled = False
        if self.busy:
            return
        res = self.model.step(self.loop.now)
        if res.idle:
            self.on_step(self, res)  # timers may have expired held KV
            t = self.model.next_timer()
            if t is not None and t > self.loop.now and (self._timer_at is None or t < self._timer_at):
                self._timer_at = t
                self.loop.at(t, self._wake)
            return
        self.busy = True
        self.steps += 1
        self.busy_s += res.duration
        self.loop.at(res.end, self._end, res)

    def _wake(self) -> None:
        self._timer_at = None
        self.kick()

    def _end(self, res: StepResult) -> None:
        self.busy = False
        self.on_step(self, res)
        if not self._scheduled and (self.model.has_work() or self.model.next_timer() is not None):
            self._start()  # the next step starts where this one ended, as the live driver's loop does
