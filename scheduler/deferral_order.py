"""The order a wait room's pump evaluates its waiters in (scheduler/deferral.py): cheapest priority
first, with the fairness floor's turns for the long prompts (``defer_floor_every``)."""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator

from scheduler.deferral_params import DeferParams
from scheduler.deferral_waiter import Waiter

#: the fairness floor's long class is cut at a quantile of this many most recent prompts offered
FLOOR_WINDOW = 1000


class PumpOrder:
    """The pump's order, and what it carries across pumps: the prompts recently offered (the
    floor's long class) and the room's dispatches by priority since the floor's last one."""

    def __init__(self) -> None:
        self.since_floor = 0  # the room's dispatches by priority since the floor's last one
        self.lengths: deque[int] = deque(maxlen=FLOOR_WINDOW)  # with the floor: recent prompts offered

    def offered(self, prompt_tokens: int) -> None:
        """A request arrived at the room with the floor on: its prompt joins the window."""
        self.lengths.append(prompt_tokens)

    def dispatched(self, floor_turn: bool) -> None:
        """The room dispatched a waiter on the floor's turn or by priority."""
        self.since_floor = 0 if floor_turn else self.since_floor + 1

    def waiters(self, waiting: dict[str, Waiter], now: float, p: DeferParams,
                share: Callable[[Waiter], float] | None = None) -> Iterator[tuple[Waiter, bool]]:
        """The waiters in the order a pump evaluates them, each with whether it is the floor's turn.

        Cheapest priority first (cost minus ``aging`` x waited; with ``slack_aging`` the cost is
        scaled by the share of the TTFT SLO still left). With the fairness floor (``floor_every`` k),
        once k - 1 dispatches in a row went by priority the next one is the floor's: the cheapest by
        the same priority among the long prompts (at least ``floor_quantile`` of the recent prompts
        offered) that their last evaluation placed within the SLO. Cheapest, not least slack: a long
        prompt with its prefix cached costs a fraction of an uncached one, and the floor is paid in
        prefill capacity (least slack first lost 13-24 points at conversation 30 s / 12x). A floor
        turn that dispatches nobody hands the next evaluation back to the priority order, so the
        floor never spends the pump's budget alone. The count since the floor's last dispatch runs
        across pumps. ``p``: the room's settings as they are now; ``share``: a waiter's size with
        its prefill shared with the waiters it shares a prefix with (``defer_share``)."""
        aging = p.aging
        size: Callable[[Waiter], float] = share if share is not None else (lambda w: w.size_s)
        if p.slack_aging:
            def key(w: Waiter) -> tuple[float, int]:
                left = 1.0 - (now - w.arrived_s) / (w.slo.ttft_s or math.inf)
                return size(w) * max(left, 0.0) + aging * w.arrived_s, w.seq
        else:
            def key(w: Waiter) -> tuple[float, int]:
                return size(w) + aging * w.arrived_s, w.seq
        by_priority = sorted(waiting.values(), key=key)
        if not p.floor_every:
            for w in by_priority:
                yield w, False
            return
        cut = _quantile(self.lengths, p.floor_quantile)
        urgent = [w for w in by_priority if w.latest_s < math.inf and w.facts.prompt_tokens >= cut]
        tried: set[int] = set()
        i = j = 0
        floor_missed = False
        while True:
            nxt: Waiter | None = None
            floor_turn = False
            if self.since_floor >= p.floor_every - 1 and not floor_missed:
                while j < len(urgent) and urgent[j].seq in tried:
                    j += 1
                if j < len(urgent):
                    nxt, floor_turn = urgent[j], True
            if nxt is None:
                while i < len(by_priority) and by_priority[i].seq in tried:
                    i += 1
                if i == len(by_priority):
                    return
                nxt = by_priority[i]
            tried.add(nxt.seq)
            yield nxt, floor_turn
            # a floor turn whose waiter still waits: the next evaluation is the priority order's
            floor_missed = floor_turn and nxt.facts.request_id in waiting


def _quantile(xs: deque[int], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs`` (the smallest x with at least q of them <= x); -inf if empty."""
    if not xs:
        return -math.inf
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
