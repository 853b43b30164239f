"""Benchmark of ``conductor simulate``: how fast virtual time runs, and how its cost grows.

    .venv/bin/python bench/simulate.py [--quick] [--policy conductor]

Prints one JSON line per measurement on stdout (progress on stderr). Each measurement runs in
its own process, so its peak RSS is its own:

1. ``full_trace``: the whole Mooncake conversation trace (12,031 requests) on 8P+8D
   llama3-70b-a800x8, policy conductor, one process: wall, CPU, peak RSS, events/s and
   simulated seconds per wall second (targets: <= 60 s wall, <= 2 GB RSS).
2. ``growth_requests``: wall at 1k / 4k requests (12k is the full run) on the same cluster.
3. ``growth_instances``: wall at 4 / 16 / 64 instances (2P+2D, 8P+8D, 32P+32D) on a fixed 2k-request
   slice, the trace sped up in proportion to the cluster (0.5x per 4 instances) so that each one
   stays about as busy.

``--quick``: 1k requests instead of the full trace, growth at 250 / 500, instances on 500 requests.
The machine is shared: CPU seconds are the figure to compare between runs; wall also counts
time the process waited for a core.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRACE = ROOT / "data" / "traces" / "mooncake_conversation_trace.jsonl"
PROFILE = "llama3-70b-a800x8"


def measure(spec: dict) -> dict:
    """One simulation in this process; returns its figures."""
    from loadgen.arrivals import sped_up
    from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec
    from loadgen.simulate.run import simulate
    from loadgen.workload import read_trace

    w = read_trace(str(TRACE), limit=spec["requests"])
    if spec["speedup"] != 1.0:
        w = sped_up(w, spec["speedup"])
    cluster = ClusterSpec(prefill=spec["prefill"], decode=spec["decode"], profile=PROFILE)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    run = simulate(w, cluster, SchedulerSpec(policy=spec["policy"]), label=spec["measure"], progress=sys.stderr)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    st = run.stats
    return {**spec, "requests": len(w.requests), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "rss_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "events": st.events, "events_per_s": round(st.events / wall), "simulated_s": round(st.sim_s, 1),
            "sim_s_per_wall_s": round(st.sim_s / wall, 1), "engine_steps": st.engine_steps,
            "ok": sum(r.status == "ok" for r in run.records),
            "rejected": sum(r.status == "rejected" for r in run.records)}


def plan(quick: bool, policy: str) -> list[dict]:
    def spec(measure: str, requests: int | None, p: int, d: int, speedup: float = 1.0) -> dict:
        return {"measure": measure, "requests": requests, "prefill": p, "decode": d, "speedup": speedup,
                "profile": PROFILE, "policy": policy}

    full = 1000 if quick else None  # None: the whole trace
    out = [spec("full_trace", full, 8, 8)]
    out += [spec("growth_requests", n, 8, 8) for n in ((250, 500) if quick else (1000, 4000))]
    slice_n = 500 if quick else 2000
    for p in (2, 8) if quick else (2, 8, 32):
        out.append(spec("growth_instances", slice_n, p, p, speedup=0.5 * (2 * p) / 4))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short version (a minute or two)")
    ap.add_argument("--policy", default="conductor")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one measurement, print its JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))), flush=True)
        return 0
    specs = plan(args.quick, args.policy)
    for k, spec in enumerate(specs, 1):
        print(f"[{k}/{len(specs)}] {spec['measure']}: {spec['requests'] or 'all'} requests, "
              f"{spec['prefill']}P+{spec['decode']}D, speed-up {spec['speedup']}", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], stdout=subprocess.PIPE,
                           text=True, check=True)
        print(r.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
