"""What deferred dispatch adds to a decision: ``WaitRoom.offer`` against a plain ``decide`` on
bench/decision_latency.py's world (64P+64D, --quick: 100k indexed blocks), and one ``pump``.

Two identical worlds (same seed) decide the same request stream, one through ``lc.decide`` and
one through a wait room with ``defer=on``, alternating blocks of 100 decisions so a busy moment
of a shared machine lands on both. The room's horizon is chosen so that about half the arrivals
find the chosen queue longer (``--horizon``): those are evaluated, held, and later re-evaluated by
``pump`` (timed per call, with how many waited). Prints one JSON line; wall milliseconds
(``perf_counter_ns``), figures from a shared machine.

Run: ``.venv/bin/python bench/defer_latency.py [--decisions 2000] [--horizon 0.5] [--scan 4] [--spill]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decision_latency as dl  # noqa: E402

from predictors.telemetry import SLO, RequestRecord  # noqa: E402
from scheduler.deferral import DeferParams, WaitRoom  # noqa: E402
from scheduler.lifecycle import RequestLifecycle  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--horizon", type=float, default=0.5, help="the wait room's horizon (s)")
    ap.add_argument("--scan", type=int, default=DeferParams.scan, help="defer_scan: misses in a row per pump")
    ap.add_argument("--spill", action="store_true", help="defer_spill: a waiter bound to a busy instance is "
                    "evaluated again among those with room (an evaluation more per such waiter)")
    ap.add_argument("--spill-ratio", type=float, default=DeferParams.spill_ratio, help="defer_spill_ratio")
    a = ap.parse_args()
    worlds = []
    for defer in (False, True):
        sched, world = dl.build("conductor", 1, True)
        sched.slo = SLO(ttft_s=30.0)
        room = WaitRoom(sched, DeferParams(enabled=defer, horizon_s=a.horizon, scan=a.scan, spill=a.spill,
                                              spill_ratio=a.spill_ratio))
        worlds.append((sched, world, room, dl.requests(world, a.decisions + 200), []))
    pumps: list[float] = []
    held = 0
    for block in range((a.decisions + 200) // 100):
        for sched, world, room, reqs, lat in worlds:
            clock, rng, live = world["clock"], world["rng"], world.setdefault("live", [])
            for _ in range(100):
                f = next(reqs)
                clock[0] += 0.01
                lc = RequestLifecycle(sched, RequestRecord(f.request_id, clock[0]), sched.clock)
                t0 = time.perf_counter_ns()
                d = room.offer(lc, f)
                t1 = time.perf_counter_ns()
                if block >= 2:
                    lat.append((t1 - t0) / 1e6)
                held += d is None
                dl.advance(sched, rng, live, f.request_id if hasattr(d, "prefill") else None, 256)
                if room.enabled and len(room):
                    t0 = time.perf_counter_ns()
                    out = room.pump()
                    t1 = time.perf_counter_ns()
                    if block >= 2:
                        pumps.append((t1 - t0) / 1e6)
                    for lc2, d2 in out:
                        dl.advance(sched, rng, live, lc2.request_id if hasattr(d2, "prefill") else None, 256)
                    for rid in list(room._waiting)[:-64]:  # bound the room (clients time out)
                        c = room.cancel(rid)
                        if c is not None:
                            c.finish("aborted")
    off, on = worlds[0][4], worlds[1][4]
    print(json.dumps({
        "decisions": len(off), "horizon_s": a.horizon, "scan": a.scan, "spill": a.spill, "spill_ratio": a.spill_ratio,
        "held": held, "room_counts": worlds[1][2].counts,
        "decide_p50_ms": round(statistics.median(off), 3), "decide_p99_ms": round(pct(off, 0.99), 3),
        "offer_p50_ms": round(statistics.median(on), 3), "offer_p99_ms": round(pct(on, 0.99), 3),
        "pump_calls": len(pumps), "pump_p50_ms": round(statistics.median(pumps), 3) if pumps else None,
        "pump_p99_ms": round(pct(pumps, 0.99), 3) if pumps else None}))


if __name__ == "__main__":
    main()
