"""Which decision-time feature explains store loads: the store term fitted with each candidate
third feature, scored on the held-out loads (the latest 20% of every run) against the prior.

    .venv/bin/python bench/store_load_features.py out/learned-8b-store/telemetry.jsonl

``none``: latency + bytes only (the term before ``store_busy_s``); ``recent``: the bytes written
through to the store in the last 0.5 s over the store bandwidth (``store_write_recent_bytes``);
``busy``: the link wait the learned model serves (``store_busy_s`` beyond the load's transfer).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictors import fit, fit_matrices, learned_features  # noqa: E402
from predictors.dataset import build_dataset  # noqa: E402
from predictors.telemetry import read_jsonl  # noqa: E402
from predictors.types import Tier  # noqa: E402

served = learned_features.load_features


def recent_bytes_feature(r, ts, tier, tokens, loads=1, busy_s=0.0):  # type: ignore[no-untyped-def]
    """The recent write bytes (passed in as ``busy_s``) over the store bandwidth, linear."""
    x = served(r, ts, tier, tokens, loads, 0.0)
    return x if tier != Tier.STORE else x[:2] + [busy_s / (r.store_bytes_per_s or r.net_bytes_per_s)]


def without_wait(r, ts, tier, tokens, loads=1, busy_s=0.0):  # type: ignore[no-untyped-def]
    return served(r, ts, tier, tokens, loads, 0.0)


def main(paths: list[str]) -> int:
    recs = []
    for p in paths:
        for r in read_jsonl(p):
            r.extra.setdefault("source", p)
            recs.append(r)
    ds = build_dataset(recs)
    by_id = {r.request_id: r for r in recs}
    busy = {id(p): p.store_busy_s for p in ds.prefill}
    print(f"{'feature':<8} {'coef (latency, bytes, third)':<30} {'n':>3} {'load MAPE':>9} {'prior':>6} "
          f"{'leg MAPE':>8} {'prior':>6}")
    for kind, features in (("none", without_wait), ("recent", recent_bytes_feature), ("busy", served)):
        for p in ds.prefill:
            recent = float(by_id[p.request_ids[0]].store_write_recent_bytes)
            p.store_busy_s = recent if kind == "recent" else busy[id(p)]
        fit_matrices.load_features = features  # type: ignore[assignment]
        models, missing = fit.fit_all(ds, train=lambda t: t < 0.8, calibration=None, quantiles=False)
        if "store" not in models.terms:
            print(f"{kind:<8} not fitted: {missing.get('store')}")
            continue
        m = fit.metrics_of(fit.score(models, ds, lambda row: row.t >= 0.8, ttft=False))
        load, leg = m["store_load"], m["store"]
        coef = ", ".join(f"{c:.4f}" for c in models.terms["store"].pooled.coef)
        print(f"{kind:<8} {coef:<30} {load['learned']['n']:>3} {load['learned']['mape']:>9.1%} "
              f"{load['analytic']['mape']:>6.1%} {leg['learned']['mape']:>8.1%} {leg['analytic']['mape']:>6.1%}")
    fit_matrices.load_features = served
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]) if sys.argv[1:] else print(__doc__) or 2)
