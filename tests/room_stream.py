"""A conversation-like request stream driven through a wait room, prefills finishing as predicted:
the shared driver of the deferral rules' off-means-identical tests."""
from __future__ import annotations

import json
from collections.abc import Callable

from predictors.telemetry import RequestRecord
from scheduler import Placement, RequestFacts, Scheduler
from scheduler.deferral import WaitRoom
from scheduler.hashing import block_hashes
from scheduler.lifecycle import RequestLifecycle
from tests.sched_helpers import Clock


def hold(sched: Scheduler, inst: str, tokens: list[int], bs: int) -> None:
    """``inst`` reports ``tokens``' blocks stored (a KV event)."""
    ours = block_hashes(tokens, bs)
    assert sched.index.block_stored(inst, [h + 1 for h in ours], None, tokens, bs)


def drive(sched: Scheduler, clock: Clock, prompt: Callable[[int], list[int]], marker: str, bs: int,
          steps: int = 60, dt: float = 0.05) -> tuple[list[str], int]:
    """Every decision (type and explanation, as JSON) of ``steps`` arrivals ``dt`` apart, and how
    many of them carry ``marker`` in their ``deferred`` note."""
    room = WaitRoom(sched)
    out: list[str] = []
    marked = 0
    running: list[tuple[float, str, str]] = []
    facts_of: dict[str, list[int]] = {}

    def note(d) -> None:
        nonlocal marked
        out.append(json.dumps([type(d).__name__, d.explanation], sort_keys=True, default=repr))
        marked += marker in d.explanation.get("deferred", {})
        if isinstance(d, Placement):
            running.append((clock.t + d.queue_s + d.prefill_s, d.request_id, d.prefill))

    for k in range(steps):
        clock.t = dt * k
        for done in [r for r in running if r[0] <= clock.t]:  # prefills finish as predicted
            running.remove(done)
            hold(sched, done[2], facts_of[done[1]], bs)
            sched.prefill_done(done[1])
        tokens = prompt(k)
        f = RequestFacts(f"r{k}", len(tokens), block_hashes(tokens, bs), 8)
        facts_of[f.request_id] = tokens[:len(tokens) // bs * bs]
        lc = RequestLifecycle(sched, RequestRecord(f.request_id, clock.t), clock)
        d = room.offer(lc, f)
        if d is not None:
            note(d)
        for _, d2 in room.pump():
            note(d2)
    return out, marked
