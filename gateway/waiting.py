"""The live gateway's side of deferred dispatch (the wait room of ``scheduler/deferral.py``).

A request the wait room holds awaits a future; one pump task per gateway resolves it with the
request's Placement or Rejection when a prefill queue is short enough (or its deadline passed),
and the proxy goes on exactly as after ``lc.decide``. The pump runs on the event loop like every
other scheduler call (the scheduler is not thread-safe): woken early when a request is offered,
a prefill finishes or a request ends (its queue drained), else at the room's ``next_wakeup``,
never later than :data:`MAX_SLEEP_S` while anyone waits, and not at all while nobody does.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from predictors.telemetry import RequestRecord
from scheduler import Placement, Rejection, RequestFacts, Scheduler
from scheduler.deferral import WaitRoom
from scheduler.lifecycle import RequestLifecycle

log = logging.getLogger(__name__)

#: the longest the pump sleeps while requests wait: the ledger credits queues' progress, so a
#: queue can reach the horizon with no event at all (and a load poll may correct it)
MAX_SLEEP_S = 0.1
#: the shortest: a wake-up due now (a queue predicted just over the horizon, a head running past its
#: prediction) is not a reason to spin; a prefill finishing wakes it at once anyway
MIN_SLEEP_S = 0.01
#: waiters listed by the admin view
ADMIN_LIST = 20


class WaitRoomClosed(Exception):
    """The gateway stopped (or its pump failed) while the request waited: it never reached an engine."""


class DeferringLifecycle(RequestLifecycle):
    """A request's lifecycle whose prefill completion wakes the pump (a queue just shortened)."""

    __slots__ = ("on_drained",)

    def __init__(self, *args: Any, on_drained: Callable[[], None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.on_drained = on_drained

    def prefill_finished(self, cached_tokens: int | None = None) -> Rejection | None:
        try:
            return super().prefill_finished(cached_tokens)
        finally:
            self.on_drained()


class GatewayWaitRoom:
    """The scheduler's wait room, the futures of the requests in it, and its pump task."""

    def __init__(self, scheduler: Scheduler):
        self.room = WaitRoom(scheduler)
        self.clock = scheduler.clock
        self._waiters: dict[str, tuple[RequestLifecycle, asyncio.Future[Placement | Rejection]]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.pumps = 0  # pump calls (the admin view: proof it is not spinning)
        self.pump_s = 0.0  # seconds the pumps held the event loop (the admin view: what the room costs)

    @property
    def enabled(self) -> bool:
        return self.room.enabled

    def __len__(self) -> int:
        return len(self.room)

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.create_task(self._run(), name="wait-room-pump")

    async def stop(self, why: type[Exception] = WaitRoomClosed) -> None:
        """Stop the pump and send every waiting request away with ``why`` (it held nothing)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_all(why)

    def nudge(self) -> None:
        """A queue may have drained (a prefill finished, a request ended): pump on the next loop turn."""
        if self._waiters:
            self._wake.set()

    def observe(self, _rec: RequestRecord) -> None:
        """A lifecycle observer: a finished request freed its reservation."""
        self.nudge()

    # --- one request ---------------------------------------------------------------------
    def offer(self, lc: RequestLifecycle, facts: RequestFacts) -> Placement | Rejection | None:
        """The request's first decision (``lc.decide`` with the wait room off), or None: it waits,
        and :meth:`wait` returns its decision."""
        d = self.room.offer(lc, facts)
        if d is None:
            self._waiters[lc.request_id] = (lc, asyncio.get_running_loop().create_future())
            self._wake.set()
        return d

    async def wait(self, lc: RequestLifecycle) -> Placement | Rejection:
        """The decision the pump makes for a waiting request. Cancelled (the client left, the
        server stopping): the request leaves the room holding nothing; the caller finishes it.
        Await it right after :meth:`offer` (no await between: the pump could decide first)."""
        entry = self._waiters.get(lc.request_id)
        if entry is None:
            raise WaitRoomClosed(f"request {lc.request_id} is not waiting")
        fut = entry[1]
        try:
            return await fut
        except asyncio.CancelledError:
            self._leave(lc)
            raise

    def _leave(self, lc: RequestLifecycle) -> None:
        # (decided just before the cancellation: the caller's finish releases what it reserved)
        self._waiters.pop(lc.request_id, None)
        self.room.cancel(lc.request_id)

    # --- the pump ------------------------------------------------------------------------
    def pump(self) -> int:
        """Decide what the room lets go now and hand each decision to its waiting request."""
        self.pumps += 1
        t0 = time.perf_counter()
        decided = self.room.pump()
        self.pump_s += time.perf_counter() - t0
        for lc, d in decided:
            _, fut = self._waiters.pop(lc.request_id, (None, None))
            if fut is not None and not fut.done():
                fut.set_result(d)
            elif not lc.done:  # its handler is gone: release what the decision reserved
                lc.finish("aborted", 499)
        for rid in [rid for rid in self._waiters if rid not in self.room]:
            # finished by someone else while it waited (the room dropped it): never left hanging
            _, fut = self._waiters.pop(rid)
            if not fut.done():
                fut.set_exception(WaitRoomClosed())
        return len(decided)

    def _timeout(self) -> float | None:
        if not self._waiters:
            return None  # nobody waits: sleep until someone is offered
        wake = self.room.next_wakeup()
        if wake is None or not math.isfinite(wake):
            return MAX_SLEEP_S
        return min(MAX_SLEEP_S, max(MIN_SLEEP_S, wake - self.clock()))

    async def _run(self) -> None:
        while True:
            timeout = self._timeout()
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.pump()
            except Exception:  # a bug must not leave requests waiting for ever
                log.exception("wait room: pump failed; the waiting requests are answered 503")
                self._fail_all(WaitRoomClosed)

    def _fail_all(self, why: type[Exception]) -> None:
        waiters, self._waiters = self._waiters, {}
        for rid, (_lc, fut) in waiters.items():
            self.room.cancel(rid)
            if not fut.done():
                fut.set_exception(why())

    def view(self) -> dict[str, Any]:
        """For /admin/cluster: the room's counts and the longest-waiting requests."""
        now = self.clock()
        snap = self.room.snapshot()
        rows = sorted(((now - (lc.waiting_since if lc.waiting_since is not None else now), rid, lc)
                       for rid, (lc, _) in self._waiters.items()), key=lambda r: r[:2], reverse=True)
        snap["requests"] = [{"request_id": rid, "waited_s": round(w, 4), "prompt_tokens": lc.record.prompt_tokens}
                            for w, rid, lc in rows[:ADMIN_LIST]]
        snap["pumps"] = self.pumps
        snap["pump_s"] = round(self.pump_s, 6)
        return snap
