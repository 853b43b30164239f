"""Where a decision's time goes at 64P+64D: thread CPU per stage, and the garbage collector.

Builds bench/decision_latency.py's world (``--quick``: 100k blocks), decides its request stream
with the decision log already full (so each record kept replaces one dropped, as in a gateway
that has run a while), and prints one JSON line: per stage of scheduler/stages.py (validate,
eligible, cache facts, terms, choice, admission, commit; ``decision_record`` and
``decode_candidates`` inside them) the mean thread-CPU milliseconds per decision and its share;
the decision's CPU p50/p99; and the collections per generation with their total and largest CPU
milliseconds. Stage shares, not absolute times, are what to compare on a shared machine.

Run: ``.venv/bin/python bench/decision_stages.py [--quick] [--predictors analytic | learned DIR | constant]``
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decision_latency as dl  # noqa: E402

from scheduler import stages  # noqa: E402

#: the stage functions of scheduler/stages.py, looked up there at call time (so each is timed)
STAGES = ("_validate", "_eligible", "_cache_facts", "_terms", "decode_candidates", "_choose", "_kv_waits", "_admit",
          "decision_record", "_commit")


def timed(spent: dict[str, int], name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def stage(*a: Any, **k: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return f(*a, **k)
        finally:
            spent[name] = spent.get(name, 0) + time.thread_time_ns() - t0
    return stage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100k blocks instead of ~1M")
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--predictors", nargs="+", default=["analytic"], metavar="KIND",
                    help="analytic (default), constant (predictors doing no work), or learned DIR")
    args = ap.parse_args(argv)
    kind = args.predictors
    if kind == ["analytic"]:
        models = None
    elif kind == ["constant"]:
        models = "constant"
    elif len(kind) == 2 and kind[0] == "learned":
        models = kind[1]
    else:
        ap.error("--predictors analytic | constant | learned DIR")
    sched, world = dl.build("conductor", args.seed, args.quick, models)
    reqs = dl.requests(world, 1500 + args.decisions)
    dl.run(sched, world, (next(reqs) for _ in range(1500)), warmup=1500)  # the decision log (1000) is full
    spent: dict[str, int] = {}
    for name in STAGES:
        setattr(stages, name, timed(spent, name, getattr(stages, name)))
    collections: dict[int, list[int]] = {0: [], 1: [], 2: []}
    started = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.thread_time_ns()
        else:
            collections[info["generation"]].append(time.thread_time_ns() - started[0])

    gc.collect()
    gc.freeze()  # as the gateway does after start-up
    gc.callbacks.append(on_gc)
    cpu: list[float] = []
    dl.run(sched, world, reqs, warmup=0, cpu=cpu)
    gc.callbacks.remove(on_gc)
    total = sum(cpu)
    print(json.dumps({
        "predictors": "analytic" if models is None else models, "decisions": len(cpu),
        "cpu_mean_ms": round(total / len(cpu), 4), "cpu_p50_ms": round(dl.pct(cpu, 0.5), 4),
        "cpu_p99_ms": round(dl.pct(cpu, 0.99), 4),
        "stages_ms": {k: round(v / 1e6 / len(cpu), 4) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
        "stages_share": {k: round(v / 1e6 / total, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
        "gc": {f"gen{g}": {"collections": len(ts), "total_ms": round(sum(ts) / 1e6, 2),
                           "max_ms": round(max(ts, default=0) / 1e6, 2)} for g, ts in collections.items()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
