"""What deferred dispatch adds to a decision: ``WaitRoom.offer`` against a plain ``decide`` on
bench/decision_latency.py's world (64P+64D, --quick: 100k indexed blocks), and one ``pump``.

Two identical worlds (same seed) decide the same request stream, one through ``lc.decide`` and
one through a wait room with ``defer=on``, alternating blocks of 100 decisions so a busy moment
of a shared machine lands on both. The room's horizon is chosen so that about a third of the
arrivals find the chosen queue longer (``--horizon``; 0.02 s in today's world, where 0.5 s holds
nobody): those are evaluated, held, and later re-evaluated by ``pump`` (timed per call, wall and
thread CPU, with how many evaluations it made). Prints one JSON line; milliseconds
(``perf_counter_ns``, ``thread_time_ns``), figures from a shared machine.

``--root DIR``: import the scheduler from another checkout (e.g. ``git worktree add /tmp/old main``)
instead of this one; bench/defer_pump_compare.py runs two checkouts back to back this way.

Run: ``.venv/bin/python bench/defer_latency.py [--decisions 2000] [--horizon 0.02] [--scan 4] [--spill] [--root DIR]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# ``--root DIR`` is read before the imports below, which it redirects; else this checkout
_ROOT = (Path(sys.argv[sys.argv.index("--root") + 1]) if "--root" in sys.argv[1:-1]
         else Path(__file__).resolve().parents[1])
sys.path.insert(0, str(_ROOT.resolve()))
sys.path.insert(0, str(_ROOT.resolve() / "bench"))  # its decision_latency.py puts its own root first again

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
    ap.add_argument("--horizon", type=float, default=0.02, help="the wait room's horizon (s)")
    ap.add_argument("--scan", type=int, default=DeferParams.scan, help="defer_scan: misses in a row per pump")
    ap.add_argument("--spill", action="store_true", help="defer_spill: a waiter bound to a busy instance is "
                    "evaluated again among those with room (an evaluation more per such waiter)")
    ap.add_argument("--spill-ratio", type=float, default=DeferParams.spill_ratio, help="defer_spill_ratio")
    ap.add_argument("--root", help="checkout to import the scheduler from (default: this one)")
    a = ap.parse_args()
    worlds = []
    for defer in (False, True):
        sched, world = dl.build("conductor", 1, True)
        sched.slo = SLO(ttft_s=30.0)
        room = WaitRoom(sched, DeferParams(enabled=defer, horizon_s=a.horizon, scan=a.scan, spill=a.spill,
                                              spill_ratio=a.spill_ratio))
        worlds.append((sched, world, room, dl.requests(world, a.decisions + 200), []))
    pumps: list[float] = []
    pump_cpu: list[float] = []
    evaluations = [0]
    held = 0
    sched_on = worlds[1][0]
    real_evaluate = sched_on.evaluate

    def counted(*args: object, **kw: object) -> object:
        evaluations[0] += 1
        return real_evaluate(*args, **kw)  # type: ignore[arg-type]

    sched_on.evaluate = counted  # type: ignore[method-assign]
    timed_evaluations = 0
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
                    e0 = evaluations[0]
                    c0 = time.thread_time_ns()
                    t0 = time.perf_counter_ns()
                    out = room.pump()
                    t1 = time.perf_counter_ns()
                    c1 = time.thread_time_ns()
                    if block >= 2:
                        pumps.append((t1 - t0) / 1e6)
                        pump_cpu.append((c1 - c0) / 1e6)
                        timed_evaluations += evaluations[0] - e0
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
        "pump_p99_ms": round(pct(pumps, 0.99), 3) if pumps else None,
        "pump_cpu_p50_ms": round(statistics.median(pump_cpu), 3) if pump_cpu else None,
        "pump_cpu_p99_ms": round(pct(pump_cpu, 0.99), 3) if pump_cpu else None,
        "pump_evaluations": timed_evaluations,
        "pump_cpu_ms_per_evaluation": round(sum(pump_cpu) / timed_evaluations, 4) if timed_evaluations else None,
        "root": a.root or "."}))


if __name__ == "__main__":
    main()
