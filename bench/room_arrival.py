"""What the wait room adds to a request's arrival when it goes at once (light load), on
decision_latency.py's 64P+64D world with ~100k indexed blocks (``--full``: ~1M).

The room first evaluates an arrival (``Scheduler.evaluate``: is its chosen queue over the
horizon?) and, when it goes at once, decides it (``Scheduler.decide`` through the evaluation's
frame: the evaluation's choice admitted again and committed) where deciding at arrival makes one
pass of the decision stages. Two identical worlds (same seed) take the same
request stream, alternating blocks of 100: conductor as shipped with its wait room (the horizon
set past any queue, so every arrival goes at once: the light-load path) and conductor with
``defer=off``. Prints one JSON line: per-arrival thread-CPU and wall p50 / p99 for both, and their ratio.

    .venv/bin/python bench/room_arrival.py [--full] [--arrivals 5000]
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

import decision_latency as DL  # noqa: E402

from predictors.telemetry import SLO, RequestRecord  # noqa: E402
from scheduler.deferral import WaitRoom  # noqa: E402
from scheduler.lifecycle import RequestLifecycle  # noqa: E402

SLO_30S = SLO(ttft_s=30.0, tbt_s=None)


def arrivals(sched, world, room, reqs, warmup, wall, cpu) -> None:
    clock, rng = world["clock"], world["rng"]
    live: list[str] = world.setdefault("live", [])
    for k, f in enumerate(reqs):
        clock[0] += 0.01
        lc = RequestLifecycle(sched, RequestRecord(f.request_id, clock[0]), lambda: clock[0])
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        d = room.offer(lc, f) if room is not None else lc.decide(f)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        assert d is not None, "an arrival waited: the horizon should let every one go at once"
        if k >= warmup:
            wall.append((t1 - t0) / 1e6)
            cpu.append((c1 - c0) / 1e6)
        DL.advance(sched, rng, live, f.request_id if hasattr(d, "prefill") else None, 256)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="~1M indexed blocks (default ~100k)")
    ap.add_argument("--arrivals", type=int, default=5000, help="timed arrivals per world")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    if a.arrivals < 1:
        ap.error("--arrivals must be at least 1")
    worlds = {"room": DL.build("conductor", a.seed, not a.full, slo=SLO_30S, defer_horizon_s=1e9),
              "defer=off": DL.build("conductor", a.seed, not a.full, slo=SLO_30S, defer=False)}
    rooms = {"room": WaitRoom(worlds["room"][0]), "defer=off": None}
    assert worlds["room"][0].defer.enabled and not worlds["defer=off"][0].defer.enabled
    streams = {k: DL.requests(w, a.arrivals + 500) for k, (_, w) in worlds.items()}
    out = {k: {"wall": [], "cpu": []} for k in worlds}
    done = 0
    while done < a.arrivals + 500:
        n = min(100, a.arrivals + 500 - done)
        for k, (sched, w) in worlds.items():
            chunk = [next(streams[k]) for _ in range(n)]
            arrivals(sched, w, rooms[k], chunk, max(0, min(n, 500 - done)), out[k]["wall"], out[k]["cpu"])
        done += n
    res = {k: {f"{m}_p{round(q * 100)}_ms": round(DL.pct(v[m], q), 4) for m in ("cpu", "wall") for q in (0.5, 0.99)}
           for k, v in out.items()}
    res["cpu_p50_ratio"] = round(statistics.median(out["room"]["cpu"]) / statistics.median(out["defer=off"]["cpu"]), 3)
    res["evaluations"] = rooms["room"].counts["evaluations"]
    print(json.dumps({"arrivals": a.arrivals, "blocks": "~1M" if a.full else "~100k", **res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
