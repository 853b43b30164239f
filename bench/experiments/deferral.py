"""Deferred dispatch ("late binding", scheduler/deferral.py) at the goodput-curves points where
goodput-bound.md does not exclude 1.2x (issue 15).

    .venv/bin/python bench/experiments/deferral.py [--train 1000] [--eval 1500] [--workers 2]
        [--workloads conversation,azure_code,synthetic] [--reuse-models] [--from-results]
        [--tune-only [--row SETTING ...] [--point TTFT@LOAD ...]] [--setting S [--floor-setting F ...]]
        [--floor-only --floor-setting F ...]
        [--store [--baseline-defer POLICY ...] [--rerun-off all|missing] [--store-models]]

Per workload, as goodput_curves.py: predictors calibrated on telemetry of the *training* slice;
the deferral setting tuned there (conductor with defer on, each setting of the grid at each of the
points; the best mean attainment over every workload and point wins); then on the *evaluation*
slice at each point: conductor with defer off and on (the tuned setting), and the best other policy of
goodput-curves/results.json at that point, off and on; attainment by prompt-length quartile.
Beside them: the best other's stored attainment and the LP bound of goodput-bound/results.json.
With extra settings (``--floor-setting``), also conductor with each, and a per-workload table: the
setting each workload's own training slice prefers of the page's and the extra ones.
Writes docs/experiments/deferral.md (+ results.json); full outputs in out/experiments/deferral/.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import _common as C
import baselines as B
import overload_admission as O

from predictors.telemetry import SLO, RequestRecord  # noqa: E402

PAGE = "deferral"


def floor_run(setting: str) -> str:
    """The label of conductor's run with a fairness-floor setting (--floor-setting)."""
    return "conductor + defer + " + setting.removeprefix("tuned, ")
# (TTFT SLO, load): the points of goodput-curves.md where goodput-bound.md does not exclude 1.2x
POINTS: dict[str, list[tuple[float, float]]] = {
    "conversation": [(5.0, 8.0), (30.0, 8.0), (30.0, 12.0), (30.0, 16.0)],
    "azure_code": [(5.0, 4.0), (5.0, 8.0), (5.0, 12.0), (30.0, 36.0)],
    "synthetic": [(30.0, 2.5), (30.0, 3.5)],
}
# deferral settings tried on the training slices: the horizon (seconds of predicted prefill queue
# within which a request goes at once), aging, and the last-chance rule (slack 1: hold only what
# plain admission would refuse), and spill (a waiter whose chosen instance is over the horizon goes to the
# policy's choice among those within it if it meets its remaining SLO there; "x1.5": only if that costs
# at most 1.5x its cheapest prefill)
# the setting chosen before (horizon 1 s, aging 0.05, scan 64), the base of the placement rows: conductor's
# work weight, and wait holder (a request the policy sends off its cheapest instance because that one's queue
# is over the horizon waits for it while it still meets its SLO there; "xR": only if the other instance's
# prefill costs more than R x the holder's)
_BASE: dict[str, Any] = {"defer_horizon_s": 1.0, "defer_aging": 0.05, "defer_scan": 64}
# the tuned setting (base + wait holder x1.5), the base of the fairness rows: "floor k" (every k-th dispatch of
# the room goes to the cheapest waiter among the longest quarter of the recent prompts that can still meet its
# SLO), "slack aging" (priority = cost x share of the TTFT SLO left), and a plain larger aging for comparison
_TUNED: dict[str, Any] = {**_BASE, "defer_wait_holder": True, "defer_holder_ratio": 1.5}
_SHARE_JOIN: dict[str, Any] = {**_TUNED, "defer_share": True, "defer_join": True}  # conversation's choice
GRID: dict[str, dict[str, Any]] = {
    "horizon 0.25 s": {"defer_horizon_s": 0.25},
    "horizon 1 s": {"defer_horizon_s": 1.0},
    "horizon 4 s": {"defer_horizon_s": 4.0},
    "horizon 1 s, aging 0.05": {"defer_horizon_s": 1.0, "defer_aging": 0.05},
    "horizon 1 s, aging 0.05, scan 64": {"defer_horizon_s": 1.0, "defer_aging": 0.05, "defer_scan": 64},
    "horizon 1 s, aging 0.05, spill": {"defer_horizon_s": 1.0, "defer_aging": 0.05, "defer_spill": True},
    "horizon 1 s, aging 0.05, scan 64, spill": {"defer_horizon_s": 1.0, "defer_aging": 0.05, "defer_scan": 64,
                                                 "defer_spill": True},
    "horizon 1 s, aging 0.05, spill x1.5": {"defer_horizon_s": 1.0, "defer_aging": 0.05, "defer_spill": True,
                                            "defer_spill_ratio": 1.5},
    "horizon 1 s, aging 0.05, scan 64, spill x1.5": {"defer_horizon_s": 1.0, "defer_aging": 0.05, "defer_scan": 64,
                                                      "defer_spill": True, "defer_spill_ratio": 1.5},
    "horizon 1 s, aging 0.05, scan 64, w 2": {**_BASE, "work_weight": 2.0},
    "horizon 1 s, aging 0.05, scan 64, w 4": {**_BASE, "work_weight": 4.0},
    "horizon 1 s, aging 0.05, scan 64, w 8": {**_BASE, "work_weight": 8.0},
    "horizon 1 s, aging 0.05, scan 64, wait holder x1": {**_BASE, "defer_wait_holder": True,
                                                         "defer_holder_ratio": 1.0},
    "horizon 1 s, aging 0.05, scan 64, wait holder x1.5": {**_BASE, "defer_wait_holder": True,
                                                         "defer_holder_ratio": 1.5},
    "horizon 1 s, aging 0.05, scan 64, wait holder x2": {**_BASE, "defer_wait_holder": True,
                                                         "defer_holder_ratio": 2.0},
    "horizon 1 s, aging 0.05, scan 64, wait holder x3": {**_BASE, "defer_wait_holder": True,
                                                         "defer_holder_ratio": 3.0},
    "horizon 1 s, aging 0.05, scan 64, wait holder x1.5, fallback": {**_BASE, "defer_wait_holder": True,
                                                                   "defer_holder_ratio": 1.5,
                                                                   "defer_holder_fallback": True},
    "horizon 1 s, aging 0.05, scan 64, wait holder x2, fallback": {**_BASE, "defer_wait_holder": True,
                                                                 "defer_holder_ratio": 2.0,
                                                                 "defer_holder_fallback": True},
    # the wait room sized by its share of both pools, not prefill alone (defer_size=pools; the synthetic
    # live page's setting), with and without aging
    "tuned, pools": {**_TUNED, "defer_size": "pools"},
    "tuned, pools, aging 0": {**_TUNED, "defer_size": "pools", "defer_aging": 0.0},
    "tuned, aging 0": {**_TUNED, "defer_aging": 0.0},
    # pools' sizes are the prefill's over 8 instances: aging 0.05 against them is 0.4 against prefill sizes
    "tuned, aging 0.4": {**_TUNED, "defer_aging": 0.4},
    # the page's setting with one knob moved (per-workload tuning, deferral.md's discussion)
    "tuned, horizon 0.5 s": {**_TUNED, "defer_horizon_s": 0.5},
    "tuned, horizon 2 s": {**_TUNED, "defer_horizon_s": 2.0},
    "tuned, horizon 0.25 s": {**_TUNED, "defer_horizon_s": 0.25},
    "tuned, horizon 0.75 s": {**_TUNED, "defer_horizon_s": 0.75},
    "tuned, pools, horizon 0.5 s": {**_TUNED, "defer_size": "pools", "defer_horizon_s": 0.5},
    "tuned, holder x1.25": {**_TUNED, "defer_holder_ratio": 1.25},
    "tuned, aging 0.1": {**_TUNED, "defer_aging": 0.1},
    "tuned, scan 128": {**_TUNED, "defer_scan": 128},
    # the room's order with a prefix shared by several waiters costed once for all of them (defer_share)
    "tuned, share": {**_TUNED, "defer_share": True},
    "tuned, share, horizon 0.25 s": {**_TUNED, "defer_share": True, "defer_horizon_s": 0.25},
    # no arrival overtakes the room: one that would go at once joins it while anyone waits (defer_join)
    "tuned, join": {**_TUNED, "defer_join": True},
    "tuned, pools, join": {**_TUNED, "defer_size": "pools", "defer_join": True},
    "tuned, share, join": _SHARE_JOIN,
    # conversation's training choice with one knob moved
    **{f"tuned, share, join, {name}": {**_SHARE_JOIN, **knobs} for name, knobs in (
        ("aging 0.1", {"defer_aging": 0.1}), ("horizon 0.5 s", {"defer_horizon_s": 0.5}),
        ("scan 128", {"defer_scan": 128}), ("aging 0", {"defer_aging": 0.0}),
        ("aging 0.025", {"defer_aging": 0.025}), ("aging 0.2", {"defer_aging": 0.2}),
        ("aging 0.1, horizon 0.5 s", {"defer_aging": 0.1, "defer_horizon_s": 0.5}))},
    "tuned, floor 4": {**_TUNED, "defer_floor_every": 4},
    "tuned, floor 8": {**_TUNED, "defer_floor_every": 8},
    "tuned, floor 16": {**_TUNED, "defer_floor_every": 16},
    "tuned, floor 12": {**_TUNED, "defer_floor_every": 12},
    "tuned, floor 24": {**_TUNED, "defer_floor_every": 24},
    "tuned, floor 32": {**_TUNED, "defer_floor_every": 32},
    "tuned, slack aging": {**_TUNED, "defer_slack_aging": True},
    "tuned, slack aging, floor 16": {**_TUNED, "defer_slack_aging": True, "defer_floor_every": 16},
    "tuned, slack aging, floor 32": {**_TUNED, "defer_slack_aging": True, "defer_floor_every": 32},
    "tuned, slack aging, floor 8": {**_TUNED, "defer_slack_aging": True, "defer_floor_every": 8},
    "tuned, aging 0.2": {**_TUNED, "defer_aging": 0.2},
    "horizon 1 s, last chance": {"defer_horizon_s": 1.0, "defer_last_chance": True, "defer_slack": 0.0},
    "horizon 1 s, hold only the refused": {"defer_horizon_s": 1.0, "defer_last_chance": True, "defer_slack": 1.0},
}

DISCUSSION = """## Discussion

(hand-written; kept when the command regenerates the block above)
"""


def defer_params(variant: str | None) -> dict[str, Any]:
    return {} if variant is None else {"defer": True, **GRID[variant]}


def _run(job: tuple[Any, ...]) -> dict[str, Any]:
    """One simulation (a worker process): summary, attainment by prompt-length quartile, waits."""
    w, spec, policy, load, ttft, tbt_ms, model_dir, horizon, out = job
    slo = SLO(ttft, tbt_ms / 1000)
    summary, recs = O.sweep(w, spec, [policy], load, slo, model_dir, defer_params(horizon), 1,
                            None if out is None else Path(out))[policy]
    return {**summary, "quartiles": O.quartiles({"x": recs}, slo)["runs"]["x"],
            "cuts": O.quartiles({"x": recs}, slo)["cuts"], **waits(recs, slo), "transfers": transfers(recs)}


def transfers(recs: list[RequestRecord]) -> dict[str, int]:
    """Prompt tokens of the completed requests, and of those the decisions pulled: from the shared
    store, from a peer prefill instance (0 unless the cluster models peer pulls: ``ClusterSpec.peer_pull``)."""
    ok = [r for r in recs if r.status == "ok"]
    return {"prompt_tokens": sum(r.prompt_tokens for r in ok),
            "store_tokens": sum(r.transfer_tokens for r in ok if r.transfer_from == "store"),
            "peer_tokens": sum(r.transfer_tokens for r in ok if r.transfer_from not in (None, "store"))}


def waits(recs: list[RequestRecord], slo: SLO) -> dict[str, Any]:
    waited = [r for r in recs if "wait_s" in r.extra]
    ok = [r for r in waited if r.meets(slo)]
    return {"waited": len(waited), "deadline": sum(r.reject_reason == "deadline" for r in recs),
            "floor": sum(bool(r.extra.get("floor")) for r in recs),
            "floor_met_slo": sum(bool(r.extra.get("floor")) and r.meets(slo) for r in recs),
            "waited_met_slo": len(ok),
            "wait_mean_s": statistics.mean(r.extra["wait_s"] for r in waited) if waited else None}


def _pool(jobs: list[tuple[Any, ...]], workers: int) -> list[dict[str, Any]]:
    with ProcessPoolExecutor(workers) as ex:
        return list(ex.map(_run, jobs))


def prepare(name: str, a: argparse.Namespace) -> dict[str, Any]:
    spec, train_w, eval_w, out, model_dir = B.calibrated_world(name, a, PAGE)
    cache = out / "tuning.json"
    # as JSON reads it back (tuples become lists), or a stored key never equals a fresh one
    key = json.loads(json.dumps({"grid": GRID, "points": POINTS[name], "train": len(train_w.requests)}))
    tuning: dict[str, Any] = {}
    fairness: dict[str, Any] = {}  # the training slice's attainment by prompt-length quartile, per point and setting
    if a.reuse_models and cache.exists() and json.loads(cache.read_text())["key"] == key:
        saved = json.loads(cache.read_text())
        tuning, fairness = saved["tuning"], saved.get("fairness", {})
    if not tuning:
        grid: list[str | None] = [None, *GRID]
        jobs = [(train_w, spec, "conductor", load, ttft, a.slo_tbt_ms, str(model_dir), h, None)
                for ttft, load in POINTS[name] for h in grid]
        res = iter(_pool(jobs, a.workers))
        for ttft, load in POINTS[name]:
            runs = {h or "off": next(res) for h in grid}
            row = {h: v["slo_attainment"] for h, v in runs.items()}
            tuning[f"{ttft:g}@{load:g}"] = row
            fairness[f"{ttft:g}@{load:g}"] = {h: v["quartiles"] for h, v in runs.items()}
            print(f"  tune {name} {ttft:g}s {load:g}: " + ", ".join(
                f"{k} {v:.3f} (Q4 {runs[k]['quartiles'][-1]:.3f})" for k, v in row.items()),
                file=sys.stderr, flush=True)
        C.save_json(cache, {"key": key, "tuning": tuning, "fairness": fairness})
    return {"name": name, "spec": spec, "eval_w": eval_w, "model_dir": str(model_dir), "tuning": tuning,
            "fairness": fairness, "out": out, "train": len(train_w.requests)}


def choose(prepared: list[dict[str, Any]]) -> str:
    """The setting with the best mean training attainment over every point (ties: the earlier)."""
    names = list(GRID)
    score = {h: statistics.mean(r[h] for p in prepared for r in p["tuning"].values()) for h in names}
    return max(names, key=lambda h: (round(score[h], 6), -names.index(h)))


def choose_floor(prepared: list[dict[str, Any]], base: str) -> str | None:
    """The fairness floor's setting: of the rows tuned with ``base``'s setting under them (named
    "tuned, ..."), the one whose Q4 attainment is no lower than conductor's without deferral ("off") at
    the most training points, then the smallest mean loss of attainment against ``base``."""
    rows = [h for h in GRID if h.startswith("tuned, ")]
    pts = [(p["tuning"][k], p["fairness"][k]) for p in prepared for k in p["tuning"]]
    if not rows or any(base not in t for t, _ in pts):
        return None

    def score(h: str) -> tuple[int, float]:
        fair = sum(f[h][-1] >= f["off"][-1] for _, f in pts)
        return fair, -statistics.mean(t[base] - t[h] for t, _ in pts)
    return max(rows, key=score)


def stored() -> tuple[dict[tuple[str, float, float], dict[str, Any]], dict[tuple[str, float, float], dict[str, Any]]]:
    """goodput-curves' points (best other, its attainment, conductor's) and goodput-bound's."""
    curves = json.loads((C.DOCS / "goodput-curves" / "results.json").read_text())
    bound = json.loads((C.DOCS / "goodput-bound" / "results.json").read_text())
    pts = {(r["workload"], pt["ttft_s"], pt["load"]): pt for r in curves["results"] for pt in r["points"]}
    bnd = {(p["workload"], p["ttft_s"], p["load"]): p for p in bound["points"]}
    return pts, bnd


def evaluate(p: dict[str, Any], a: argparse.Namespace, horizon: str, floors: list[str]) -> dict[str, Any]:
    curves, bound = stored()
    name, w, spec, mdir = p["name"], p["eval_w"], p["spec"], p["model_dir"]
    jobs, keys = [], []
    extra = [(floor_run(f), "conductor", f) for f in floors]
    for ttft, load in POINTS[name]:
        best = curves[(name, ttft, load)]["best"]
        out = p["out"] / f"ttft{ttft:g}-{load:g}"
        for label, policy, h in (("conductor", "conductor", None), ("conductor + defer", "conductor", horizon),
                                 ("best other", best, None), ("best other + defer", best, horizon), *extra):
            jobs.append((w, spec, policy, load, ttft, a.slo_tbt_ms, mdir, h, str(out / label.replace(" + ", "-"))))
            keys.append((ttft, load, label))
    res = dict(zip(keys, _pool(jobs, a.workers), strict=True))
    points = []
    for ttft, load in POINTS[name]:
        c, b = curves[(name, ttft, load)], bound[(name, ttft, load)]
        runs = {label: res[(ttft, load, label)] for label in
                ("conductor", "conductor + defer", "best other", "best other + defer", *(x[0] for x in extra))}
        points.append({"ttft_s": ttft, "load": load, "best": c["best"],
                       "stored_best": c["runs"][c["best"]]["slo_attainment"],
                       "stored_conductor": c["runs"]["conductor"]["slo_attainment"],
                       "bound": b["mean"]["attainment_bound"], "runs": runs})
        print(f"  {name} {ttft:g}s {load:g}: " + ", ".join(f"{k} {v['slo_attainment']:.3f}" for k, v in runs.items()),
              file=sys.stderr, flush=True)
    return {"workload": name, "train": p["train"], "eval": len(w.requests), "tuning": p["tuning"], "points": points}


def render(results: list[dict[str, Any]], horizon: str, a: argparse.Namespace, command: str,
           floors: list[str]) -> str:
    rows, frows, lrows, flrows = [], [], [], []
    for r in results:
        for pt in r["points"]:
            runs = pt["runs"]
            cu, co = runs["conductor"]["slo_attainment"], runs["conductor + defer"]["slo_attainment"]
            bo, bd = runs["best other"]["slo_attainment"], runs["best other + defer"]["slo_attainment"]
            best_any = max(bo, bd)
            lbl = f"{pt['ttft_s']:g} s", load_label(r["workload"], pt["load"])
            rows.append([r["workload"], *lbl, pt["best"], C.pct(pt["stored_best"]), C.pct(bo), C.pct(bd),
                         C.pct(cu), f"**{C.pct(co)}**", f"{100 * (co - cu):+.1f}",
                         f"{cu / max(bo, 1e-9):.2f}x", f"**{co / max(bo, 1e-9):.2f}x**",
                         f"{co / max(best_any, 1e-9):.2f}x", C.pct(pt["bound"]), f"{co / pt['bound']:.2f}",
                         f"{1.2 * bo / pt['bound']:.2f}"])
            for f in floors:
                fl = runs[floor_run(f)]
                q4 = runs["conductor"]["quartiles"][-1], runs["conductor + defer"]["quartiles"][-1], fl["quartiles"][-1]
                fa = fl["slo_attainment"]
                flrows.append([r["workload"], *lbl, f.removeprefix("tuned, "), C.pct(q4[0]), C.pct(q4[1]),
                               f"**{C.pct(q4[2])}**", "yes" if q4[2] >= q4[0] else "**no**", C.pct(co),
                               f"**{C.pct(fa)}**", f"{100 * (fa - co):+.1f}", f"{fa / max(bo, 1e-9):.2f}x",
                               f"{fl.get('floor', '-')} / {fl.get('floor_met_slo', '-')}"])
            for label in ("conductor", "conductor + defer", "best other", "best other + defer",
                          *(floor_run(f) for f in floors)):
                v = runs[label]
                name = label.replace("best other", pt["best"])
                frows.append([r["workload"], *lbl, name, *[C.pct(x) for x in v["quartiles"]]])
                lrows.append([r["workload"], *lbl, name, C.pct(v["slo_attainment"]), v["rejected"], v["deadline"],
                              v["unreachable"], v["late_ttft"], v["late_tbt"], v["waited"], v["waited_met_slo"],
                              "-" if v["wait_mean_s"] is None else C.sec(v["wait_mean_s"]),
                              C.sec(v["ttft_mean_s"]), C.pct(v["hit_ratio"])])
    summary = C.md_table(["workload", "TTFT SLO", "load", "best other", "best other (stored)", "best other (rerun)",
                          "best other + defer", "conductor", "conductor + defer", "defer gain (points)",
                          "conductor / best other", "conductor + defer / best other",
                          "conductor + defer / best of (best other, best other + defer)", "bound",
                          "conductor + defer / bound", "1.2x the best other / bound"], rows)
    tuning = tuning_table(results)
    fair = C.md_table(["workload", "TTFT SLO", "load", "run", "Q1 (shortest prompts)", "Q2", "Q3",
                       "Q4 (longest)"], frows)
    loss = C.md_table(["workload", "TTFT SLO", "load", "run", "attainment", "refused", "of which deadline",
                       "unreachable", "late TTFT", "late TBT", "waited", "waited and met the SLO", "mean wait (s)",
                       "TTFT mean (s)", "prefix hit"], lrows)
    per_workload = per_workload_table(results, horizon, floors)
    named = "; ".join(f"**{f.removeprefix('tuned, ')}**: " + ", ".join(
        f"{k}={v}" for k, v in GRID[f].items() if k not in GRID[horizon] or GRID[horizon][k] != v) for f in floors)
    floor_block = "" if not floors else f"""
**Extra settings** (`--floor-setting`: conductor with the setting above plus {named}; a fairness floor or
another order, from the training slices, see the discussion; "conductor + defer + ..." in the tables below;
a floor's target: Q4 no lower than conductor's without deferral, attainment at most ~1 point under
conductor + defer; "floor dispatches": the floor's dispatches / those that met the SLO, "-" for none):

{C.md_table(["workload", "TTFT SLO", "load", "floor setting", "Q4 conductor", "Q4 conductor + defer",
             "Q4 + floor", "Q4 + floor >= conductor", "conductor + defer", "+ floor", "floor cost (points)",
             "+ floor / best other", "floor dispatches"], flrows)}"""
    return f"""
**Command** (regenerates this block and results.json):

```
{command}
```

**Setup.** As [goodput-curves.md](goodput-curves.md): {a.prefill}P+{a.decode}D `{B.PROFILE}`,
TBT <= {a.slo_tbt_ms:g} ms, every policy admitting against the SLO with the same learned predictors
(calibrated here again on telemetry of conductor with the analytic prior replaying the first
{results[0]['train']} requests of each trace, the synthetic generator with seed 1), evaluated on the next
{results[0]['eval']} (seed 0). Only the {sum(len(v) for v in POINTS.values())} points where
[goodput-bound.md](goodput-bound.md) does not exclude 1.2x. "Defer" = deferred dispatch (`defer=on`,
scheduler/deferral.py): a request whose chosen prefill instance has more than the horizon of predicted
queue, or that is refused for TTFT only while drained queues would meet it, waits at the gateway holding
nothing; waiting requests are dispatched cheapest predicted prefill first as queues drain, against what
is left of their TTFT SLO, and refused (`deadline`) once even drained queues cannot meet it. Setting tuned
on the *training* slices (conductor, the grid of the tuning table below; best mean attainment over every
point): **{horizon}** ({', '.join(f'{k}={v}' for k, v in GRID[horizon].items())}), used for every run with
defer below. "Best other" = the best other policy at that point in goodput-curves/results.json
("stored": its attainment there; "rerun": the same policy rerun here with this run's calibration).
Ratios are attainment ratios at equal offered load (= goodput ratios); bound = the mean-step-time
attainment bound of goodput-bound/results.json (no policy can exceed it); the last column is the share
of that bound 1.2x the best other needs.

{summary}{floor_block}{per_workload}
**Tuning** (conductor on the *training* slice; SLO attainment; "aging 0.05": 0.05 s of predicted
cost forgiven per second waited; "scan 64": a pump gives up after 64 evaluations in a row that
dispatched nobody (default 4); "last chance": a waiting request is dispatched behind a long queue once
waiting longer would lose it; "hold only the refused": admissible requests go at once, only those plain
admission would refuse for TTFT wait; "spill": a waiting request whose chosen instance is over the horizon
goes to the policy's choice among the instances within it if it meets its remaining SLO there, "x1.5" only
if its prefill there costs at most 1.5x its cheapest; "w N": conductor's work weight N instead of 1; "wait
holder xR": a request the policy would send off its cheapest instance (the holder of its prefix) because that
one's queue is over the horizon waits for it while it meets its remaining SLO there, queue included, if
recomputing elsewhere costs more than R x its prefill there; "fallback": only while the policy's choice would
still meet the SLO once the holder has room):

{tuning}
**Fairness**: SLO attainment by prompt-length quartile of the evaluation slice:

{fair}
**Where the requests went**:

{loss}"""


def per_workload(r: dict[str, Any], settings: list[str]) -> str:
    """Of ``settings``, the one with the best mean attainment over this workload's training points
    (ties: the earlier): the choice of an operator who tunes the room on their own traffic."""
    rows = r["tuning"].values()
    return max(settings, key=lambda h: (round(statistics.mean(t[h] for t in rows), 6), -settings.index(h)))


def per_workload_table(results: list[dict[str, Any]], horizon: str, floors: list[str]) -> str:
    """conductor + defer with each workload's own training choice among the page's setting and the
    extra ones (``--floor-setting``), against the best other: empty without extra settings."""
    if not floors:
        return ""
    settings, rows = [horizon, *floors], []
    for r in results:
        h = per_workload(r, settings)
        for pt in r["points"]:
            v = pt["runs"]["conductor + defer" if h == horizon else floor_run(h)]["slo_attainment"]
            bo = pt["runs"]["best other"]["slo_attainment"]
            rows.append([r["workload"], f"{pt['ttft_s']:g} s", load_label(r["workload"], pt["load"]),
                         h.removeprefix("tuned, "), f"**{C.pct(v)}**", pt["best"], C.pct(bo),
                         f"**{v / max(bo, 1e-9):.2f}x**", "yes" if v >= 1.2 * bo else "no"])
    return f"""
**Per workload** (the setting each workload's own training slice prefers, of the page's and the extra
ones: the best mean training attainment over that workload's points; "best other" as in the first table):

{C.md_table(["workload", "TTFT SLO", "load", "setting (tuned on the workload)", "conductor + defer",
             "best other", "best other (rerun)", "conductor + defer / best other", "1.2x or more"], rows)}"""


def tuning_table(results: list[dict[str, Any]]) -> str:
    """Conductor's training-slice attainment per point and setting of the grid (and off)."""
    keys = ["off", *GRID]
    trows = []
    for r in results:
        for k, row in r["tuning"].items():
            ttft, load = k.split("@")
            trows.append([r["workload"], f"{ttft} s", load_label(r["workload"], float(load)),
                          *[C.pct(row[x]) for x in keys]])
    return C.md_table(["workload (training slice)", "TTFT SLO", "load", *keys], trows)


load_label = B.load_label


def floor_only(a: argparse.Namespace) -> str:
    """Conductor with each fairness-floor setting on the evaluation slices against the page's stored
    conductor and conductor + defer runs: attainment, Q4, the floor's cost and its dispatches."""
    saved = json.loads((C.DOCS / PAGE / "results.json").read_text())
    stored_runs = {(r["workload"], pt["ttft_s"], pt["load"]): pt["runs"]
                   for r in saved["results"] for pt in r["points"]}
    rows = []
    for name in a.workloads.split(","):
        spec, _, eval_w, out, mdir = B.calibrated_world(name, a, PAGE)
        jobs = [(eval_w, spec, "conductor", load, ttft, a.slo_tbt_ms, str(mdir), f, None)
                for ttft, load in POINTS[name] for f in a.floor_setting]
        res = iter(_pool(jobs, a.workers))
        for ttft, load in POINTS[name]:
            st = stored_runs[(name, ttft, load)]
            off, de = st["conductor"], st["conductor + defer"]
            for f in a.floor_setting:
                v = next(res)
                q4 = v["quartiles"][-1]
                rows.append([name, f"{ttft:g} s", load_label(name, load), f.removeprefix("tuned, "),
                             C.pct(off["slo_attainment"]), C.pct(off["quartiles"][-1]), C.pct(de["slo_attainment"]),
                             C.pct(de["quartiles"][-1]), C.pct(v["slo_attainment"]), C.pct(q4),
                             "yes" if q4 >= off["quartiles"][-1] else "no",
                             f"{100 * (v['slo_attainment'] - de['slo_attainment']):+.1f}",
                             f"{v['floor']} / {v['floor_met_slo']}"])
                print("  " + " | ".join(rows[-1]), file=sys.stderr, flush=True)
    return C.md_table(["workload", "TTFT SLO", "load", "floor setting", "conductor", "Q4", "conductor + defer", "Q4",
                       "+ floor", "Q4", "Q4 >= conductor's", "floor cost (points)", "floor dispatches / met SLO"],
                      rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.sim_arguments(p, ",".join(POINTS))
    p.add_argument("--setting", choices=list(GRID), default=None, help="skip tuning: use this setting")
    p.add_argument("--floor-setting", action="append", choices=list(GRID), default=[],
                   help="also evaluate conductor with this setting (a fairness floor's, tuned with --tune-only; "
                        "repeatable; needs --setting)")
    p.add_argument("--reuse-models", action="store_true",
                   help="skip calibration (and tuning) when out/experiments/deferral/<workload> has them")
    p.add_argument("--from-results", action="store_true", help="re-render the page from its results.json")
    p.add_argument("--tune-only", action="store_true",
                   help="calibrate and tune on the training slices, print the tuning table; no evaluation, no page")
    p.add_argument("--row", action="append", choices=list(GRID), default=None,
                   help="with --tune-only: tune only this setting (repeatable; 'off' is always run)")
    p.add_argument("--point", action="append", default=None, metavar="TTFT@LOAD",
                   help="with --tune-only: tune at this point only (e.g. 30@12; repeatable, of each workload's points)")
    p.add_argument("--floor-only", action="store_true",
                   help="with --floor-setting: only conductor with those settings on the evaluation slices, printed "
                        "against the page's results.json (its conductor runs, same calibration); no page")
    p.add_argument("--store", action="store_true",
                   help="with a shared KV store, at the points still short of 1.2x, reusing this page's models: "
                        "writes deferral-store.md (bench/experiments/deferral_store.py)")
    p.add_argument("--baseline-defer", action="append", default=[], metavar="POLICY",
                   help="with --store: also run this baseline with the tuned deferral (repeatable)")
    p.add_argument("--rerun-off", choices=["all", "missing"], default=None,
                   help="with --store: also rerun without the store (same predictors and slice) every run, or only "
                        "those missing from this page's results.json")
    p.add_argument("--store-models", action="store_true",
                   help="with --store: the same runs with predictors calibrated with the store on; a printed table, "
                        "no page")
    a = p.parse_args()
    if a.store:
        store_page(a)
        return
    if a.floor_only:
        if not a.floor_setting:
            p.error("--floor-only needs --floor-setting")
        print(floor_only(a))
        return
    if (a.row or a.point) and not a.tune_only:
        p.error("--row and --point need --tune-only (the page's choice is over the whole grid and every point)")
    if a.tune_only:
        for k in [k for k in GRID if a.row and k not in a.row]:
            del GRID[k]
        if a.point:
            for n in POINTS:
                POINTS[n] = [(t, x) for t, x in POINTS[n] if f"{t:g}@{x:g}" in a.point]
        prepared = [prepare(n, a) for n in a.workloads.split(",") if POINTS[n]]
        print(tuning_table([{"workload": x["name"], "tuning": x["tuning"]} for x in prepared]))
        print("Q4 (longest prompts):")
        print(tuning_table([{"workload": x["name"], "tuning": {k: {h: q[-1] for h, q in v.items()}
                                                             for k, v in x["fairness"].items()}} for x in prepared]))
        print(f"best mean over these points: {choose(prepared)}")
        base = "horizon 1 s, aging 0.05, scan 64, wait holder x1.5"
        print(f"fairness floor (Q4 >= off's at the most points, then the least loss against {base}): "
              f"{choose_floor(prepared, base)}")
        return
    if a.from_results:
        saved = json.loads((C.DOCS / PAGE / "results.json").read_text())
        results, command, horizon = saved["results"], saved["command"], saved["setting"]
        floors = saved.get("floor_settings", [])
        GRID.clear()
        GRID.update(saved["grid"])
    else:
        floors = a.floor_setting
        if floors and a.setting is None:
            p.error("--floor-setting needs --setting (the floor is measured against that setting)")
        if a.setting is not None:
            for k in [k for k in GRID if k != a.setting and k not in floors]:
                del GRID[k]
        prepared = [prepare(n, a) for n in a.workloads.split(",")]
        horizon = a.setting if floors else choose(prepared)
        print(f"tuned on the training slices: {horizon}", file=sys.stderr, flush=True)
        results, command = [evaluate(x, a, horizon, floors) for x in prepared], C.command_line()
    C.save_json(C.DOCS / PAGE / "results.json", {"command": command, "profile": B.PROFILE, "setting": horizon,
                                                 "floor_settings": floors, "grid": GRID, "results": results})
    C.write_doc(C.DOCS / f"{PAGE}.md", "Deferred dispatch (late binding) at the points where 1.2x is not excluded",
                render(results, horizon, a, command, floors), DISCUSSION, command)
    print(f"wrote {C.DOCS / PAGE}.md")


def store_page(a: argparse.Namespace) -> None:
    """--store: deferral-store.md (its runs, or re-rendered from its results.json)."""
    import deferral_store as S

    if a.store_models:
        rows = [row for n in a.workloads.split(",") if n in S.POINTS for row in S.store_models(n, a)]
        print(C.md_table(["workload", "TTFT SLO", "load", "run (store on, store-calibrated predictors)", "attainment",
                          "/ best other", "prefix hit", "from the store", "deadline"], rows))
        return
    if a.from_results:
        saved = json.loads((C.DOCS / S.PAGE / "results.json").read_text())
        results, command = saved["results"], saved["command"]
    else:
        results = [S.evaluate(n, a) for n in a.workloads.split(",") if n in S.POINTS]
        command = C.command_line()
    C.save_json(C.DOCS / S.PAGE / "results.json", {"command": command, "profile": B.PROFILE, "setting": S.DEFER,
                                                   "results": results})
    C.write_doc(C.DOCS / f"{S.PAGE}.md", "The shared KV store at the points where deferral is short of 1.2x",
                S.render(results, a, command), DISCUSSION, command)
    print(f"wrote {C.DOCS / S.PAGE}.md")


if __name__ == "__main__":
    main()
