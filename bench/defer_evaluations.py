"""How much work the wait room does in a ``conductor simulate`` run: pumps, evaluations, and what
each pump evaluation of a waiting request ended in (kept waiting, dispatched, refused).

    .venv/bin/python bench/defer_evaluations.py <conductor simulate arguments>

Why: virtual time makes an evaluation free, so the simulator's attainment says nothing of what
the room would cost a live gateway, whose event loop pays about a millisecond per evaluation. Runs
the simulator in this process with the room's ``pump`` and ``_reconsider`` counted, then prints the
counts as one JSON line after the simulator's own output.
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import scheduler.deferral as deferral  # noqa: E402
from gateway.cli import main  # noqa: E402
from scheduler.types import Placement  # noqa: E402


def counted() -> Counter[str]:
    """Count the room's pumps and the outcome of each re-evaluation of a waiting request."""
    counts: Counter[str] = Counter()
    pump, reconsider = deferral.WaitRoom.pump, deferral.WaitRoom._reconsider

    def counting_pump(self):  # type: ignore[no-untyped-def]
        counts["pumps"] += 1
        return pump(self)

    def counting_reconsider(self, w, now):  # type: ignore[no-untyped-def]
        out = reconsider(self, w, now)
        if out is None:
            counts["kept waiting"] += 1
        else:
            counts["dispatched" if isinstance(out[1], Placement) else f"refused {out[1].reason}"] += 1
        return out

    deferral.WaitRoom.pump = counting_pump  # type: ignore[method-assign]
    deferral.WaitRoom._reconsider = counting_reconsider  # type: ignore[method-assign]
    return counts


if __name__ == "__main__":
    tally = counted()
    try:
        main(["simulate", *sys.argv[1:]])
    finally:
        print(json.dumps({"room": dict(tally), "reconsidered": sum(v for k, v in tally.items() if k != "pumps")}))
