"""Drives an :class:`EngineModel` in scaled real time inside asyncio and hands tokens to streams.

Modelled time M = (loop time - t0) / time_scale. While busy, step k+1 starts exactly at the
modelled end of step k and the loop sleeps until that instant's wall time, so Python overhead
does not leak into modelled latencies (if the process falls behind, the modelled clock lags the
wall clock and arrivals are stamped no later than the engine's clock). When nothing can run the
loop awaits new work or the next engine timer (KV load done, held KV expiry): no busy loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .metrics import Metrics
from .model import EngineModel, Finished, FirstToken, SimRequest, StepResult
from .publisher import KVEventPublisher

log = logging.getLogger(__name__)


class RequestStream:
    """Mailbox between the engine loop and one HTTP handler."""

    __slots__ = ("request_id", "tokens", "first", "finished", "_waiter", "last_token_at")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.tokens: list[int] = []
        self.first: FirstToken | None = None
        self.finished: Finished | None = None
        self._waiter: asyncio.Future | None = None
        self.last_token_at = 0.0

    async def wait(self) -> None:
        """Return once tokens or the end are available."""
        if self.tokens or self.finished is not None:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class EngineDriver:
    def __init__(self, engine: EngineModel, *, time_scale: float = 1.0, metrics: Metrics | None = None,
                 publisher: KVEventPublisher | None = None,
                 on_kv_loaded: Callable[[str], None] | None = None,
                 on_store_writes: Callable[[list], None] | None = None):
        self.engine = engine
        self.scale = time_scale
        self.metrics = metrics
        self.publisher = publisher
        self.on_kv_loaded = on_kv_loaded
        self.on_store_writes = on_store_writes  # prompts to write through to the shared store
        self.on_store_evicted: Callable[[list], None] | None = None  # write-back: blocks the device evicted
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._busy_until: float | None = None  # modelled end of the step in flight
        self._last_end = 0.0  # modelled end of the last step (the clock never runs backwards)
        self._first_arrival: float | None = None  # earliest arrival while idle: the next step starts there
        self.steps = 0
        self.busy_s = 0.0  # modelled seconds spent computing steps
        self.lag_s = 0.0  # wall seconds the loop has fallen behind (CPU-bound at this time scale)

    # --- clock ------------------------------------------------------------------------------
    def wall_model_time(self) -> float:
        return (self._loop.time() - self._t0) / self.scale

    def now(self) -> float:
        """Modelled time to stamp an arrival with (never ahead of the engine's own clock)."""
        m = self.wall_model_time()
        b = self._busy_until
        return m if b is None or m < b else b

    # --- requests ---------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> RequestStream:
        """Queue a request; raises ValueError (engine's refusal) before anything is registered."""
        now = self.now()
        self.engine.add_request(req, now)
        if self._busy_until is None and (self._first_arrival is None or now < self._first_arrival):
            self._first_arrival = now
        st = RequestStream(req.request_id)
        self._streams[req.request_id] = st
        self._wake.set()
        return st

    def abort(self, request_id: str) -> bool:
        self._streams.pop(request_id, None)
        found = self.engine.abort(request_id)
        self._wake.set()
        return found

    def release_kv(self, request_id: str) -> bool:
        found = self.engine.release_kv(request_id)
        self._wake.set()
        return found

    def kick(self) -> None:
        self._wake.set()

    # --- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        engine = self.engine
        loop = self._loop
        while True:
            self._wake.clear()
            if self._busy_until is not None:
                now = self._busy_until
            else:  # idle until now: start at the arrival (or timer) that woke us, not at our wake-up
                now = self.wall_model_time()
                t = engine.next_timer()
                cands = [x for x in (self._first_arrival, t) if x is not None and x <= now]
                if cands:
                    now = max(cands)
                now = max(now, self._last_end)
            self._first_arrival = None
            res = engine.step(now)
            if res.idle:
                self._busy_until = None
                self._after(res)
                t = engine.next_timer()
                timeout = None if t is None else max(0.0, (t - self.wall_model_time()) * self.scale)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            self.steps += 1
            self.busy_s += res.duration
            self._busy_until = self._last_end = res.end
            delay = self._t0 + res.end * self.scale - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                self.lag_s = -delay
                await asyncio.sleep(0)
            self._deliver(res)
            self._after(res)

    def _after(self, res: StepResult) -> None:
        if res.events and self.publisher is not None:
            self.publisher.publish(time.time(), res.events)
        if res.store_writes and self.on_store_writes is not None:
            self.on_store_writes(res.store_writes)
        if res.store_evicted and self.on_store_evicted is not None:
            self.on_store_evicted(res.store_evicted)
        if res.kv_loaded and self.on_kv_loaded is not None:
            for rid in res.kv_loaded:
                self.on_kv_loaded(rid)

    def _deliver(self, res: StepResult) -> None:
        streams = self._streams
        end = res.end
        m = self.metrics
        woken: list[RequestStream] = []
        for ft in res.first_tokens:
            st = streams.get(ft.request_id)
            if st is not None:
                st.first = ft
                st.last_token_at = end
            if m is not None:
                m.ttft.observe(ft.first_token - ft.arrival)
        itl = m.itl if m is not None else None
        for rid, tok in res.emitted:
            st = streams.get(rid)
            if st is None:
                continue
            if not st.tokens:
                woken.append(st)
            st.tokens.append(tok)
            if st.last_token_at != end:
                if itl is not None:
                    itl.observe(end - st.last_token_at)
                st.last_token_at = end
        for f in res.finished:
            if m is not None:
                m.finished(f)
            st = streams.pop(f.request_id, None)
            if st is not None:
                st.finished = f
                woken.append(st)
        for st in woken:
            st.wake()
