"""Served store-load predictions in operation: the 8B gap store cluster replays requests the
models never saw, cache-blind (round robin, so prefixes come from the store) at a light load
(so instances are idle and a load is observable alone), once with the analytic prior and once
with a model directory; each run's own served prediction of the leg (store load + prefill, as
predicted at decision) against the lone store-loading prefills' legs.

    .venv/bin/python bench/store_in_operation.py docs/runs/learned-8b-gap-store [--skip 3000] [--n 3000] [--load 0.25]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from learned_predictors import run  # noqa: E402

from engines_adapters.store.model import StoreSpec  # noqa: E402
from loadgen.arrivals import sped_up  # noqa: E402
from loadgen.simulate.cluster import ClusterSpec  # noqa: E402
from loadgen.workload import read_trace  # noqa: E402
from predictors.dataset import build_dataset  # noqa: E402
from predictors.fit import load_rows  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", help="a directory written by conductor calibrate")
    ap.add_argument("--skip", type=int, default=3000, help="requests of the trace to skip (the training ones)")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--load", type=float, default=0.25)
    ap.add_argument("--trace", default=str(ROOT / "data/traces/mooncake_conversation_trace.jsonl"))
    a = ap.parse_args()
    cluster = ClusterSpec(prefill=4, decode=4, profile="llama3-8b-h200-gap", store=StoreSpec(nodes=8))
    w = read_trace(a.trace, limit=a.skip + a.n)
    w = sped_up(dataclasses.replace(w, requests=w.requests[a.skip:]), a.load)
    print(f"== {a.n} unseen requests (after the first {a.skip}) at {a.load:g}x, round robin, 4P+4D gap, store ==")
    for name, pred in (("analytic", "analytic"), ("learned", a.models), ("oracle", "oracle")):
        recs = run(w, cluster, SLO(5.0, 0.025), pred, "s9-t0", "round_robin")
        ok = [r for r in recs if r.status == "ok"]
        for r in ok:
            r.extra["source"] = name
        by_id = {r.request_id: r for r in ok}
        ape = []
        for row in load_rows(build_dataset(ok).prefill, "store"):
            r = by_id[row.request_ids[0]]
            if r.predicted_transfer_s is not None and r.predicted_prefill_s is not None:
                ape.append(abs((r.predicted_transfer_s + r.predicted_prefill_s) / row.service_s - 1))
        print(f"{name:<9} lone store-loading prefills {len(ape):>3}: served leg MAPE "
              f"{np.mean(ape) if ape else float('nan'):6.1%}, APE p50 {np.median(ape) if ape else float('nan'):6.1%}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
