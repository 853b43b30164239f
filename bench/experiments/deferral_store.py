"""deferral.py --store: the shared KV store at deferral.md's short points (issue 15's "no store,
no peer pulls" hypothesis, measured with the tuned deferral).

    .venv/bin/python bench/experiments/deferral.py --store --reuse-models --workers 1
        [--workloads conversation,synthetic] [--baseline-defer POLICY ...] [--rerun-off all|missing]
        [--store-models] [--from-results]

The predictors are deferral.md's (its calibrated models in out/experiments/deferral/<workload>/models,
calibrated without a store; recalibrated there when missing), so only the store differs from its runs.
At each point where conductor + the tuned deferral is short of 1.2x in deferral.md, with
``StoreSpec(nodes=prefill+decode)`` (as baselines.py --store): conductor with deferral off and on,
the best other policy of deferral.md at that point and the best-hit baselines, and (``--baseline-defer``)
some of those with the same deferral. Beside them, the store-off figures of deferral/results.json and
(``--rerun-off``) the same runs rerun without the store. ``--store-models``: the store-on runs again with
predictors calibrated with the store on, printed (no page).
Each run's summary is kept in out/experiments/deferral-store/<workload>/ttft<S>-<load>/<run>.json and
reused with --reuse-models, so an interrupted grid resumes. Writes docs/experiments/deferral-store.md
(+ results.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import _common as C
import baselines as B
import deferral as D
import future_value as F

from engines_adapters.store.model import StoreSpec  # noqa: E402
from predictors.calibrate import calibrate  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402

PAGE = "deferral-store"
# (TTFT SLO, load): where conductor + the tuned deferral is short of 1.2x in deferral.md
POINTS: dict[str, list[tuple[float, float]]] = {
    "conversation": [(5.0, 8.0), (30.0, 8.0)],
    "synthetic": [(30.0, 2.5)],
}
# deferral.md's best other at these points first, then the best-hit baselines
BASELINES: dict[str, list[str]] = {
    "conversation": ["prefix_only", "sglang_cache_aware", "dynamo_cost"],
    "synthetic": ["sglang_cache_aware", "prefix_only", "dynamo_cost"],
}
DEFER = "horizon 1 s, aging 0.05, scan 64, wait holder x1.5"  # deferral.md's tuned setting


def slug(label: str) -> str:
    return label.replace(" + ", "-")


def labels(name: str, baseline_defer: list[str]) -> list[tuple[str, str, str | None]]:
    """(label, policy, deferral setting) of the runs at each point of ``name``, in the order run."""
    best, *rest = BASELINES[name]
    runs: list[tuple[str, str, str | None]] = [("conductor", "conductor", None),
                                               ("conductor + defer", "conductor", DEFER), (best, best, None)]
    runs += [(f"{best} + defer", best, DEFER)] if best in baseline_defer else []
    runs += [(b, b, None) for b in rest]
    return runs + [(f"{b} + defer", b, DEFER) for b in rest if b in baseline_defer]


def store_off(name: str, ttft: float, load: float) -> dict[str, dict[str, float]]:
    """deferral/results.json's runs at this point (no store), under this page's labels."""
    saved = json.loads((C.DOCS / "deferral" / "results.json").read_text())
    for r in saved["results"]:
        for pt in r["points"]:
            if r["workload"] == name and (pt["ttft_s"], pt["load"]) == (ttft, load):
                best = pt["best"]
                names = {"conductor": "conductor", "conductor + defer": "conductor + defer", "best other": best,
                         "best other + defer": f"{best} + defer"}
                return {names[k]: {"slo_attainment": v["slo_attainment"], "hit_ratio": v["hit_ratio"]}
                        for k, v in pt["runs"].items() if k in names}
    return {}


def evaluate(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """Each point's runs with the store and, with ``a.rerun_off``, the same runs without it ("missing":
    only those deferral/results.json lacks)."""
    spec_off, _, eval_w, _, model_dir = B.calibrated_world(name, a, "deferral")  # deferral.md's predictors
    spec_on = dataclasses.replace(spec_off, store=StoreSpec(nodes=a.prefill + a.decode))
    points, follows = [], F.follow_ups(eval_w)
    for ttft, load in POINTS[name]:
        out = C.OUT / PAGE / name / f"ttft{ttft:g}-{load:g}"
        runs: dict[str, dict[str, Any]] = {"on": {}, "off": {}}
        stored = store_off(name, ttft, load)
        for mode, spec in [("on", spec_on), *([("off", spec_off)] if a.rerun_off else [])]:
            for label, policy, defer in labels(name, a.baseline_defer):
                if mode == "off" and a.rerun_off == "missing" and label in stored:
                    continue
                path = out / (slug(label) if mode == "on" else f"off-{slug(label)}")
                v = runs[mode][label] = cached_run(a, eval_w, spec, policy, (ttft, load), str(model_dir), defer, path)
                print(f"  {name} {ttft:g}s {load:g} store {mode}: {label} {v['slo_attainment']:.3f} "
                      f"hit {v['hit_ratio']:.3f}", file=sys.stderr, flush=True)
        slo = SLO(ttft, a.slo_tbt_ms / 1000)
        follow = {f"{mode} {label}": F.follow_up_stats(out / (slug(label) if mode == "on" else f"off-{slug(label)}"),
                                                       follows, slo)
                  for mode in runs for label in runs[mode]}
        points.append({"ttft_s": ttft, "load": load, "runs": runs["on"], "rerun_off": runs["off"],
                       "store_off": stored, "follow": follow})
    return {"workload": name, "eval": len(eval_w.requests), "points": points}


def cached_run(a: argparse.Namespace, w: Any, spec: Any, policy: str, point: tuple[float, float], model_dir: str,
               defer: str | None, path: Path, **tag: str) -> dict[str, Any]:
    """One run's summary (deferral.py's), kept in ``path``.json and reused with --reuse-models
    (``tag``: more of what made it, in its key)."""
    key = {"policy": policy, "defer": D.defer_params(defer), "eval": len(w.requests),
           "store": None if spec.store is None else dataclasses.asdict(spec.store), **tag}
    cache = path.with_suffix(".json")
    if a.reuse_models and cache.exists() and json.loads(cache.read_text())["key"] == key:
        return dict(json.loads(cache.read_text())["summary"])
    v = D._run((w, spec, policy, point[1], point[0], a.slo_tbt_ms, model_dir, defer, str(path)))
    C.save_json(cache, {"key": key, "summary": v})
    return v


def store_models(name: str, a: argparse.Namespace) -> list[list[str]]:
    """--store-models: the same runs with the store on, the predictors calibrated with the store on
    (as baselines.py --store: a learned store term that reads the store's traffic) instead of
    deferral.md's; rows of a printed table, no page."""
    spec = dataclasses.replace(C.cluster(a.prefill, a.decode), profile=B.PROFILE,
                               store=StoreSpec(nodes=a.prefill + a.decode))
    train_w, eval_w = B.slices(name, a.train, a.eval)
    mdir = C.OUT / PAGE / name / "models-store"
    if not (a.reuse_models and (mdir / "models.json").exists()):
        calibrate(B.telemetry(train_w, spec, SLO(5.0, a.slo_tbt_ms / 1000), B.TRAIN_LOADS[name]), str(mdir),
                  holdout="random", draw=False)
    rows = []
    for ttft, load in POINTS[name]:
        out = C.OUT / PAGE / name / f"ttft{ttft:g}-{load:g}"
        runs = {label: cached_run(a, eval_w, spec, policy, (ttft, load), str(mdir), defer, out / f"cal-{slug(label)}",
                                  models="store")
                for label, policy, defer in labels(name, a.baseline_defer)}
        b = runs[best_other(runs)]["slo_attainment"]
        for k, v in runs.items():
            t = v["transfers"]
            rows.append([name, f"{ttft:g} s", D.load_label(name, load), k, C.pct(v["slo_attainment"]),
                         f"{v['slo_attainment'] / max(b, 1e-9):.2f}x", C.pct(v["hit_ratio"]),
                         C.pct(t["store_tokens"] / max(t["prompt_tokens"], 1)), v["deadline"]])
            print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    return rows


def best_other(runs: dict[str, Any], defer: bool = False) -> str:
    """The other policy's run with the best attainment (``defer``: with or without deferral)."""
    others = [k for k in runs if not k.startswith("conductor") and (defer or not k.endswith(" + defer"))]
    return max(others, key=lambda k: runs[k]["slo_attainment"] or 0)


def ratio(runs: dict[str, Any], label: str = "conductor + defer", defer: bool = False) -> str:
    """``label``'s attainment over the best other run's (``defer``: with or without deferral),
    and which that was."""
    if label not in runs or not any(not k.startswith("conductor") for k in runs):
        return "-"
    bo = best_other(runs, defer)
    return f"{runs[label]['slo_attainment'] / max(runs[bo]['slo_attainment'], 1e-9):.2f}x ({bo})"


def _off_cells(v: dict[str, Any], off: dict[str, Any] | None, rerun: bool) -> list[str]:
    """A run's store-off figures (where from) and what the store added."""
    if off is None:
        return ["-", "-", "-", "-"]
    pulled = sum(off.get("transfers", {}).get(k, 0) for k in ("store_tokens", "peer_tokens")) if rerun else "-"
    return [C.pct(off["slo_attainment"]), C.pct(off["hit_ratio"]), f"{pulled} ({'rerun' if rerun else 'deferral.md'})",
            f"{100 * ((v['slo_attainment'] or 0) - (off['slo_attainment'] or 0)):+.1f}"]


def render(results: list[dict[str, Any]], a: Any, command: str) -> str:
    rows, hrows = [], []
    for r in results:
        for pt in r["points"]:
            rerun = pt.get("rerun_off", {})
            runs, off = pt["runs"], {**pt["store_off"], **rerun}  # without the store: deferral.md's or rerun here
            lbl = [r["workload"], f"{pt['ttft_s']:g} s", D.load_label(r["workload"], pt["load"])]
            bo, bd = best_other(runs), best_other(runs, defer=True)
            b, bany = runs[bo]["slo_attainment"], runs[bd]["slo_attainment"]
            cu, co = runs["conductor"]["slo_attainment"], runs["conductor + defer"]["slo_attainment"]
            rows.append([*lbl, f"{bo} {C.pct(b)}", f"{bd} {C.pct(bany)}", C.pct(cu), f"**{C.pct(co)}**",
                         f"{cu / max(b, 1e-9):.2f}x", f"**{co / max(b, 1e-9):.2f}x**", f"{co / max(bany, 1e-9):.2f}x",
                         ratio(off, "conductor"), ratio(off), ratio(off, defer=True)])
            for k, v in runs.items():
                t = v.get("transfers", {})
                store = t.get("store_tokens", 0) / max(t.get("prompt_tokens", 0), 1)
                hit = v["hit_ratio"] or 0
                hrows.append([*lbl, f"**{k}**" if k.startswith("conductor") else k, C.pct(v["slo_attainment"]),
                              C.pct(hit), C.pct(store), "-" if not hit else f"{store / hit:.0%}",
                              t.get("peer_tokens", "-"), *_off_cells(v, off.get(k), k in rerun)])
    frows = [[r["workload"], f"{pt['ttft_s']:g} s", D.load_label(r["workload"], pt["load"]),
              f"**{k}**" if k.split(" ", 1)[1].startswith("conductor") else k,
              f"{C.pct(f['follow_met'])} (n {f['follow_ups']})", C.pct(f["follow_refused"]),
              f"{C.pct(f['new_met'])} (n {f['new']})", f"{C.pct(f['same_instance'])} (n {f['pairs']})",
              f["pulled"]] for r in results for pt in r["points"] for k, f in pt.get("follow", {}).items()]
    follow = "" if not frows else "\n**Follow-ups** (as [future-value.md](future-value.md): a request continuing " \
        "more than 25% of its prompt beyond the common prefix; store on / off):\n\n" + C.md_table(
            ["workload", "TTFT SLO", "load", "store, run", "follow-ups meeting the SLO", "follow-ups refused",
             "new requests meeting it", "follow-ups on their earlier request's instance",
             "completed requests that loaded from the store"], frows)
    summary = C.md_table(["workload", "TTFT SLO", "load", "best other (store on)", "best other incl. + defer",
                          "conductor", "conductor + defer", "conductor / best other",
                          "conductor + defer / best other", "conductor + defer / best incl. + defer",
                          "store off: conductor / best other", "store off: conductor + defer / best other",
                          "store off: conductor + defer / best incl. + defer"], rows)
    hits = C.md_table(["workload", "TTFT SLO", "load", "run", "attainment (store on)", "prefix hit",
                       "from the store (share of prompt tokens)", "store share of the hit", "peer-pulled tokens",
                       "attainment (store off)", "prefix hit (store off)", "pulled tokens (store off; from)",
                       "store gain (points)"], hrows)
    store = StoreSpec(nodes=a.prefill + a.decode)
    return f"""
**Command** (regenerates this block and results.json):

```
{command}
```

**Setup.** As [deferral.md](deferral.md) ({a.prefill}P+{a.decode}D `{B.PROFILE}`, TBT <= {a.slo_tbt_ms:g} ms,
the same learned predictors: its models, calibrated on the first {a.train} requests without a store;
evaluation on the next {results[0]['eval']}), plus a shared Mooncake-style store as baselines.py --store
configures it ({store.nodes} nodes, {store.dram_bytes / 2**30:g} GiB DRAM each, write-through: prefill
instances write every prompt they compute and load from it what they lack beyond their own prefix, whatever
the policy). Only the points where conductor + deferral is short of 1.2x in deferral.md. "+ defer" =
deferred dispatch with deferral.md's tuned setting ({', '.join(f'{k}={v}' for k, v in D.defer_params(DEFER).items())}).
"Best other" = the other policy with the best attainment in this run (store on), without deferral; "incl. +
defer": also counting the baselines run with deferral. Ratios are attainment ratios at equal offered load
(= goodput ratios). Store off: deferral/results.json's runs (the same predictors and evaluation slice: conductor
and its best other, each with and without deferral) and, for the baselines it lacks, reruns here without
the store (`--rerun-off missing`); the best other without the store is the best of those.

**SLO attainment, store on:**

{summary}
**Per run** (prefix hit = cached / prompt tokens of completed requests, as the engines report; from the
store = the tokens each decision had loaded from the store, over the completed requests' prompt tokens;
peer-pulled: tokens the decisions pulled from another prefill instance):

{hits}{follow}"""
