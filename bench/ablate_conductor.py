"""Ablation of the conductor policy in the virtual-time simulator: one line per variant.

    .venv/bin/python bench/ablate_conductor.py --limit 1000 --speedup 5 \\
        alg1:conductor_alg1 inflight:conductor:work_weight=0 full:conductor dyn:dynamo_cost

A variant is ``NAME:POLICY[:KEY=VALUE,...]``; ``predictors=oracle|analytic`` and
``admission=false`` are read from the parameters too. Each variant is one fresh simulated
cluster on the same workload; variants run in parallel worker processes. Prints SLO attainment
(requests meeting TTFT and TBT / requests sent), how many were admitted and refused, TTFT of the
completed ones, and the engines' prefix-hit ratio (cached / prompt tokens of completed requests).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.arrivals import sped_up  # noqa: E402
from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec  # noqa: E402
from loadgen.simulate.oracle import predictors_factory  # noqa: E402
from loadgen.simulate.run import simulate  # noqa: E402
from loadgen.workload import bundled_trace, read_trace  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402

ARGS: argparse.Namespace | None = None


def workload(a: argparse.Namespace):
    w = read_trace(a.trace, limit=a.skip + a.limit)
    reqs = w.requests[a.skip:]
    t0 = reqs[0].arrival_s
    return sped_up(replace(w, requests=[replace(r, arrival_s=r.arrival_s - t0) for r in reqs]), a.speedup)


def run(variant: str) -> dict:
    a = ARGS
    assert a is not None
    name, policy, *rest = variant.split(":")
    params: dict[str, str] = dict(kv.split("=", 1) for kv in rest[0].split(",")) if rest and rest[0] else {}
    pred = params.pop("predictors", "analytic")
    admission = params.pop("admission", "true") != "false"
    spec = ClusterSpec(prefill=a.prefill, decode=a.decode, profile=a.profile)
    slo = SLO(a.slo_ttft_ms / 1000, a.slo_tbt_ms / 1000)
    r = simulate(workload(a), spec, SchedulerSpec(policy=policy, policy_params=params, slo=slo, admission=admission),
                 predictors=predictors_factory(pred, spec), progress=None)
    ok = [x for x in r.records if x.status == "ok"]
    ttft = sorted(x.ttft_s for x in ok)
    return {"name": name, "n": len(r.records), "ok": len(ok),
            "rejected": sum(x.status == "rejected" for x in r.records),
            "attainment": sum(x.meets(slo) for x in ok) / len(r.records),
            "ttft_mean": statistics.mean(ttft), "ttft_p50": ttft[len(ttft) // 2],
            "ttft_p90": ttft[int(0.9 * len(ttft))],
            "hit": sum(x.cached_tokens or 0 for x in ok) / max(1, sum(x.prompt_tokens for x in ok))}


def main() -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(bundled_trace("mooncake_conversation_trace.jsonl")))
    p.add_argument("--skip", type=int, default=0, help="start at this request of the trace")
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--speedup", type=float, default=5.0)
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--profile", default="llama3-70b-a800x8")
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=200.0)
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("variants", nargs="+", help="NAME:POLICY[:KEY=VALUE,...]")
    ARGS = p.parse_args()
    with ProcessPoolExecutor(ARGS.workers) as ex:
        for o in ex.map(run, ARGS.variants):
            print(f"{o['name']:16s} attainment {o['attainment']:6.1%}  ok {o['ok']:5d}  rejected {o['rejected']:5d}  "
                  f"TTFT mean {o['ttft_mean']:6.2f} s p50 {o['ttft_p50']:6.2f} p90 {o['ttft_p90']:6.2f}  "
                  f"prefix hit {o['hit']:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
