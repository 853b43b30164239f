"""Learned predictors against the analytic prior, on a truth the gateway does not know.

    .venv/bin/python bench/learned_predictors.py [--profile llama3-8b-h200-gap] [--prefill 4 --decode 4]
        [--trace data/traces/mooncake_conversation_trace.jsonl] [--train 1500] [--train-loads 0.5,1,2]
        [--eval 1000] [--eval-load 2] [--slo-ttft-ms 5000] [--slo-tbt-ms 25] [--holdout time|random] [--store]
        [--host-tier-tokens N] [--out DIR]

1. Telemetry: ``simulate`` (the live scheduler, the sim engine's EngineModel in virtual time,
   analytic predictors) replays the first ``--train`` requests of the trace at each training
   load on the gap cluster; every finished request's RequestRecord is training data.
2. ``conductor calibrate`` on it (the latest 20% of every run held out, or a random 20%): held-out
   error per term, learned
   beside analytic, p90 coverage, and extrapolation (fitted on the shortest 90% of prompts,
   scored on the longest 10%).
3. Direct: lone prefills and decode steps on an idle gap engine (noise off), the learned model
   and the prior against the engine's own times, at prompt lengths up to 4x the longest the
   model was fitted on.
4. In operation: the *next* ``--eval`` requests of the trace (never seen in training) at
   ``--eval-load``, simulated with analytic and with learned predictors, same cluster and seed:
   goodput and SLO attainment, and each run's own predictions against what then happened
   (prefill on requests that found their instance idle, TBT, end-to-end TTFT).

Virtual time: the figures do not depend on the machine (the run time printed does).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from prediction_error import actual_decode_step, actual_prefill  # noqa: E402

from engines_adapters.sim.profiles import load_profile  # noqa: E402
from engines_adapters.store.model import StoreSpec  # noqa: E402
from loadgen.arrivals import sped_up  # noqa: E402
from loadgen.metrics import summarize  # noqa: E402
from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec  # noqa: E402
from loadgen.simulate.oracle import predictors_factory  # noqa: E402
from loadgen.simulate.run import simulate  # noqa: E402
from loadgen.workload import read_trace  # noqa: E402
from predictors.analytic import Prior, Roofline, roofline_decode_step_s, roofline_prefill_s  # noqa: E402
from predictors.base import DecodeState  # noqa: E402
from predictors.calibrate import calibrate  # noqa: E402
from predictors.dataset import build_dataset  # noqa: E402
from predictors.facts import load_deployment  # noqa: E402
from predictors.learned import learned_predictors  # noqa: E402
from predictors.telemetry import SLO, RequestRecord, write_jsonl  # noqa: E402


def pct(x: float | None) -> str:
    return "    —" if x is None else f"{x:6.1%}"


def run(w, cluster: ClusterSpec, slo: SLO, predictors: str, label: str, policy: str = "conductor"
        ) -> list[RequestRecord]:
    # conductor as when docs/predictors.md's figures were measured: deciding at arrival (defer=off)
    sched = SchedulerSpec(policy=policy, slo=slo, policy_params={"defer": False} if policy == "conductor" else {})
    t = time.perf_counter()
    out = simulate(w, cluster, sched, predictors=predictors_factory(predictors, cluster), progress=None,
                   label=label, id_prefix=label).records
    print(f"  simulated {label}: {len(out)} requests in {time.perf_counter() - t:.0f} s", flush=True)
    return out


def in_operation(records: list[RequestRecord], slo: SLO) -> dict[str, float | None]:
    ok = [r for r in records if r.status == "ok"]
    s = summarize(records, slo)
    ttft = [abs(r.predicted_ttft_s / r.ttft_s - 1) for r in ok if r.predicted_ttft_s and r.ttft_s]
    tbt = [abs(r.predicted_tbt_s / r.tbt_s - 1) for r in ok if r.predicted_tbt_s and len(r.intervals) > 8]
    for r in records:
        r.extra["source"] = "eval"
    ds = build_dataset(ok)
    by_id = {r.request_id: r for r in ok}
    pre = [abs(by_id[row.request_ids[0]].predicted_prefill_s / row.service_s - 1)  # type: ignore[operator]
           for row in ds.prefill if row.clean and by_id[row.request_ids[0]].predicted_prefill_s]
    return {"attainment": s["slo_attainment"], "goodput": s["goodput_rps"] or 0.0, "admitted": len(ok) / len(records),
            "ttft_p50": float(np.quantile(ttft, 0.5)) if ttft else None,
            "ttft_p90": float(np.quantile(ttft, 0.9)) if ttft else None,
            "tbt_mape": statistics.mean(tbt) if tbt else None, "prefill_mape": statistics.mean(pre) if pre else None,
            "prefill_n": len(pre)}


def p90_coverage(records: list[RequestRecord], model_dir: str) -> dict[str, tuple[float | None, float | None]]:
    """(static, served) p90 coverage per tracked term of a run served by ``model_dir``: its records
    fed, in the order they finished, to the serving path's own trackers (LearnedBundle.observe),
    once with the step the calibration tuned and once with step 0 (the calibrated p90 as is)."""
    ok = sorted((r for r in records if r.status == "ok" and r.end_s is not None), key=lambda r: r.end_s or 0.0)
    out: dict[str, list[float | None]] = {}
    for k, eta in enumerate((0.0, None)):
        lp = learned_predictors(model_dir, quantile_eta=eta)
        assert lp.bundle is not None
        for r in ok:
            for inst, dep in ((r.prefill_instance, r.prefill_deployment), (r.decode_instance, r.decode_deployment)):
                if inst is not None and dep is not None and lp.bundle.book.deployment(inst) is None:
                    lp.register(inst, load_deployment(dep), 1 << 30)
            lp.bundle.observe(r)
        for term, tr in lp.bundle.quantiles.items():
            n, c = sum(tr.n.values()), sum(tr.covered.values())
            out.setdefault(term, [None, None])[k] = c / n if n else None
    return {t: (v[0], v[1]) for t, v in out.items()}


def direct(profile: str, model_dir: str, max_fit_prompt: int) -> None:
    p = load_profile(profile)
    d = p.deployment
    prior = Roofline.from_deployment(d, Prior())
    lp = learned_predictors(model_dir, online=False)
    lp.register("x", d, p.kv_capacity_tokens)
    print(f"\n== direct: an idle {profile} engine, noise off (fitted on prompts up to {max_fit_prompt}) ==")
    print(f"{'prompt':>7} {'cached':>6} {'engine ms':>10} {'learned':>8} {'analytic':>8}")
    errs: dict[str, list[float]] = {"learned": [], "analytic": [], "learned_beyond": [], "analytic_beyond": []}
    for prompt in (512, 2048, 8192, 16384, 32768, 65536, 100_000):
        for frac in (0.0, 0.5):
            actual, cached = actual_prefill(p, prompt, frac, seed=prompt)
            lrn = lp.prefill.prefill_time("x", prompt, cached) / actual - 1
            ana = roofline_prefill_s(prior, prompt, cached) / actual - 1
            key = "_beyond" if prompt > max_fit_prompt else ""
            errs["learned" + key].append(abs(lrn))
            errs["analytic" + key].append(abs(ana))
            print(f"{prompt:>7} {cached:>6} {actual * 1e3:>10.1f} {lrn:>+8.1%} {ana:>+8.1%}")
    print(f"prefill MAPE within the fitted range: learned {pct(statistics.mean(errs['learned']))}, "
          f"analytic {pct(statistics.mean(errs['analytic']))}; beyond it: learned "
          f"{pct(statistics.mean(errs['learned_beyond']) if errs['learned_beyond'] else None)}, analytic "
          f"{pct(statistics.mean(errs['analytic_beyond']) if errs['analytic_beyond'] else None)}")
    step_l, step_a = [], []
    for batch in (1, 8, 32, 128):
        for ctx in (1024, 4096):
            actual, kv = actual_decode_step(p, batch, ctx, seed=batch + ctx)
            # a decode step at (batch, kv): the TBT predictors' question with this request included
            state = DecodeState("x", batch - 1, kv - ctx - 1)
            step_l.append(abs(lp.tbt.tbt(state, ctx, 1) / actual - 1))
            step_a.append(abs(roofline_decode_step_s(prior, batch, kv) / actual - 1))
    print(f"decode step MAPE (8 points; the learned TBT is fitted to requests' Mooncake TBT, the slowest 10% "
          f"of their gaps, so it sits above a mean step): learned {pct(statistics.mean(step_l))}, "
          f"analytic {pct(statistics.mean(step_a))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="llama3-8b-h200-gap")
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--trace", default=str(ROOT / "data/traces/mooncake_conversation_trace.jsonl"))
    ap.add_argument("--train", type=int, default=1500)
    ap.add_argument("--train-loads", default="0.5,1,2")
    ap.add_argument("--eval", type=int, default=1000)
    ap.add_argument("--eval-load", type=float, default=2.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=5000)
    ap.add_argument("--slo-tbt-ms", type=float, default=25)
    ap.add_argument("--holdout", choices=("time", "random"), default="time",
                    help="calibrate's hold-out: the latest 20%% of every run (default) or a random 20%%")
    ap.add_argument("--train-policies", default="conductor",
                    help="policies the training telemetry is simulated with, each at every training load "
                         "(e.g. conductor,round_robin: a cache-blind policy makes prefills load from the store)")
    ap.add_argument("--store", action="store_true",
                    help="a shared Mooncake-style store (conductor simulate --store): prefills load what it holds, "
                         "and the store-load term is learned")
    ap.add_argument("--host-tier-tokens", type=int, default=0,
                    help="a host-memory KV tier per engine, tokens (as conductor simulate --host-tier-tokens): "
                         "telemetry with host-tier loads")
    ap.add_argument("--out", help="keep the telemetry and models here (default: a temporary directory)")
    a = ap.parse_args()
    slo = SLO(a.slo_ttft_ms / 1e3, a.slo_tbt_ms / 1e3)
    store = StoreSpec(nodes=a.prefill + a.decode) if a.store else None  # as conductor simulate --store
    cluster = ClusterSpec(prefill=a.prefill, decode=a.decode, profile=a.profile, store=store,
                          engine={"host_tier_tokens": a.host_tier_tokens} if a.host_tier_tokens else {})
    whole = read_trace(a.trace, limit=a.train + a.eval)
    train_w = dataclasses.replace(whole, requests=whole.requests[:a.train])
    eval_w = dataclasses.replace(whole, requests=whole.requests[a.train:])
    out = a.out or tempfile.mkdtemp(prefix="conductor-learned-")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    print(f"== telemetry: {a.train} requests of {Path(a.trace).name} on {a.prefill}P+{a.decode}D {a.profile}, "
          f"{a.train_policies}, analytic predictors, loads {a.train_loads} ==", flush=True)
    records: list[RequestRecord] = []
    for k, (load, policy) in enumerate((float(x), p) for p in a.train_policies.split(",")
                                       for x in a.train_loads.split(",")):
        recs = run(sped_up(train_w, load), cluster, slo, "analytic", f"s{k}-t0", policy)
        for r in recs:
            r.extra["source"] = f"train-{load:g}"
        records += recs
    write_jsonl(os.path.join(out, "telemetry.jsonl"), records)
    model_dir = os.path.join(out, "models")
    m = calibrate(records, model_dir, holdout=a.holdout, telemetry=[f"simulated {a.train_loads}"], draw=True)
    print(f"\n== calibrate ({len(records)} records, {m['rows']}; fit {m['fit_seconds']:.1f} s): held-out "
          f"({a.holdout}) 20% ==")
    print(f"{'term':<9} {'n':>5} {'learned MAPE':>12} {'APE p50':>8} {'p90 cov static':>14} {'served':>7} "
          f"{'analytic MAPE':>13} {'APE p50':>8}")
    for term, mm in m["holdout_metrics"].items():
        lm, am = mm["learned"], mm["analytic"]
        print(f"{term:<9} {lm.get('n', 0):>5} {pct(lm.get('mape')):>12} {pct(lm.get('ape_p50')):>8} "
              f"{pct(lm.get('p90_coverage')):>14} {pct(lm.get('p90_coverage_served')):>7} {pct(am.get('mape')):>13} "
              f"{pct(am.get('ape_p50')):>8}")
    print(f"served: the online quantile tracker (step {m['online_quantile']['eta']:g}, tuned on the training rows) "
          "over the held-out rows in decision order, each outcome applied once its request ended")
    ex = m["extrapolation"]
    print(f"extrapolation (fitted on prompts <= {ex['max_prompt_tokens']}, scored on longer ones): "
          + "; ".join(f"{t} learned {pct(v['learned'].get('mape'))} analytic {pct(v['analytic'].get('mape'))}"
                      for t, v in ex["metrics"].items()))
    direct(a.profile, model_dir, ex["max_prompt_tokens"])
    print(f"\n== in operation: the next {a.eval} requests (unseen) at load {a.eval_load:g}, same cluster and seed ==",
          flush=True)
    w = sped_up(eval_w, a.eval_load)
    runs = {name: run(w, cluster, slo, pred, f"s9-t{k}")
            for k, (name, pred) in enumerate((("analytic", "analytic"), ("learned", model_dir), ("oracle", "oracle")))}
    cover = p90_coverage(runs["learned"], model_dir)  # before in_operation relabels the records
    rows = {name: in_operation(recs, slo) for name, recs in runs.items()}
    print(f"{'predictors':<10} {'attainment':>10} {'goodput/s':>9} {'admitted':>8} {'TTFT APE p50':>12} "
          f"{'p90':>6} {'TBT MAPE':>8} {'prefill MAPE (n)':>16}")
    for name, r in rows.items():
        print(f"{name:<10} {pct(r['attainment']):>10} {r['goodput']:>9.2f} {pct(r['admitted']):>8} "
              f"{pct(r['ttft_p50']):>12} {pct(r['ttft_p90']):>6} {pct(r['tbt_mape']):>8} "
              f"{pct(r['prefill_mape'])} ({r['prefill_n']})")
    print("learned p90 coverage in operation (the serving path's trackers over the run, in finishing order), "
          "static / served: " + "; ".join(f"{t} {pct(c[0]).strip()} / {pct(c[1]).strip()}" for t, c in cover.items()))
    print(f"\nmodels, metrics.json, report.md and plots in {model_dir}; total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
