"""What the shared store's links are busy with, as the gateway can know it at decision time.

A load from the store waits behind the write-through puts on the store nodes' links: an engine
with a store connector puts a prompt's new blocks when its prefill ends, and a Mooncake-style
store (engines_adapters/store/model.py) holds the link from when the put is issued, with the
step that finishes the prefill, until it has moved. So a load issued now waits until the
prefills whose last chunk is running on other instances have ended: the sim store's loads are
1.0x their own transfer at the median and 4-13x at p75-p90, and measured on its telemetry that
wait, not the bytes written recently, is what explains them (docs/predictors.md, "Store loads").
The gateway knows every placed prefill's predicted end and size, so it keeps:

* ``busy_s``: from now until the latest predicted end among placed prefills whose last chunk
  is predicted to be running now (the link time a load issued now queues behind);
* ``recent_bytes``: bytes written through in the last ``window_s`` (a running window sum);
* ``loads``: placed requests loading a prefix from the store whose prefill has not ended.

Each is kept by heaps and running sums updated by the request lifecycle's events (placed,
prefill done, released) with the scheduler's injected clock, so a decision reads them in
amortised O(log n) of the prefills in flight, never a scan. The scheduler owns one and
advances it once per decision; the learned store term reads the same snapshot.
"""
from __future__ import annotations

import heapq
from collections import deque

#: Window of recent writes (seconds): a few hundred milliseconds, about one chunked prefill step.
WINDOW_S = 0.5
#: Tokens per engine step the last-chunk estimate assumes (vLLM's default budget for large models;
#: predictors/learned_features.py CHUNK_TOKENS).
CHUNK_TOKENS = 8192


class StoreTraffic:
    """Running state of the store's write-through traffic (see the module docstring)."""

    __slots__ = ("window_s", "recent_bytes", "busy_s", "loads", "_writes", "_live", "_waiting", "_armed", "_now")

    def __init__(self, window_s: float = WINDOW_S):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.window_s = float(window_s)
        self.recent_bytes = 0  # as of the last advance()
        self.busy_s = 0.0
        self.loads = 0
        self._writes: deque[tuple[float, int]] = deque()  # (when, bytes), oldest first
        self._live: dict[str, tuple[int, bool, float]] = {}  # request -> (bytes it will write, loads, predicted end)
        self._waiting: list[tuple[float, float, str]] = []  # (last chunk starts, end, request): min-heap
        self._armed: list[tuple[float, str]] = []  # (-end, request): last chunk running, max-heap by end
        self._now = float("-inf")

    def advance(self, now: float) -> None:
        """Bring the snapshot to ``now``: expire old writes, arm prefills whose last chunk started,
        drop those ended (done or past their predicted end)."""
        self._now = now
        w, cut = self._writes, now - self.window_s
        while w and w[0][0] <= cut:
            self.recent_bytes -= w.popleft()[1]
        waiting, armed, live = self._waiting, self._armed, self._live
        while waiting and waiting[0][0] <= now:
            _, end, rid = heapq.heappop(waiting)
            if rid in live and end > now:
                heapq.heappush(armed, (-end, rid))
        while armed and (-armed[0][0] <= now or armed[0][1] not in live):
            heapq.heappop(armed)
        self.busy_s = -armed[0][0] - now if armed else 0.0

    # --- a request's life: placed -> prefill done | released ------------------------------
    def placed(self, request_id: str, now: float, write_bytes: int, loads: bool, prefill_ends_in_s: float,
               prefill_s: float, new_tokens: int) -> None:
        """A prefill was placed: it will write ``write_bytes`` through when it ends, predicted
        ``prefill_ends_in_s`` from ``now`` after ``prefill_s`` of computing ``new_tokens``."""
        self.done(request_id, None)  # a retry places the same request again
        end = now + max(0.0, prefill_ends_in_s)
        last_chunk = max(0.0, prefill_s) * min(1.0, CHUNK_TOKENS / max(1, new_tokens))
        self._live[request_id] = (max(0, write_bytes), loads, end)
        self.loads += loads
        heapq.heappush(self._waiting, (end - last_chunk, end, request_id))

    def done(self, request_id: str, now: float | None) -> None:
        """The request's prefill ended at ``now`` (its write-through starts: counted in the
        recent bytes) or, with ``now`` None, it was released before that (nothing written).
        Its heap entries go lazily, at the next :meth:`advance`."""
        p = self._live.pop(request_id, None)
        if p is None:
            return
        self.loads -= p[1]
        if now is not None and p[0] > 0:
            self._writes.append((now, p[0]))
            self.recent_bytes += p[0]

    def __len__(self) -> int:
        return len(self._live)
