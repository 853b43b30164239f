"""Future value (conductor's ``future_weight``, issue 15) at the short points of deferral.md:
conversation 5 s / 8x and 30 s / 8x, synthetic 30 s / 75 req/s.

    .venv/bin/python bench/experiments/future_value.py [--train 1000] [--eval 1500] [--workers 1]
        [--workloads conversation,synthetic] [--reuse-models] [--setting LABEL] [--from-results]

Method as least_work.py: per workload, predictors calibrated on telemetry of the *training* slice;
the setting (weight, time constant) tuned there (conductor alone, each setting of the grid and off,
at every point, with deferred dispatch off and with the setting tuned in deferral.md; the best mean
attainment over every workload and point wins, per deferral setting); then on the *evaluation*
slice at each point: the strongest baselines, conductor with the rule off and at the tuned setting,
both with deferral off and on. Beside attainment: the prefix hit of each run and of the best
baseline, the trace's reuse bound, and, per run, how follow-ups fare (attainment of the requests
that continue an earlier request's prefix vs of the new ones, and how often a follow-up went to the
instance that served the earlier request). Writes docs/experiments/future-value.md (+ results.json);
full outputs in out/experiments/future-value/.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import _common as C
import baselines as B
import goodput_curves as G
import least_work as L

from engines_adapters.sim.profiles import load_profile  # noqa: E402
from loadgen.simulate.reuse import reuse_bound  # noqa: E402
from loadgen.workload import Workload  # noqa: E402
from predictors.telemetry import SLO, RequestRecord  # noqa: E402

PAGE = "future-value"
# (TTFT SLO, load): where conductor + the tuned deferral is short of 1.2x the best other in deferral.md
# (Azure code has no prefix reuse: no conversation to place)
POINTS: dict[str, list[tuple[float, float]]] = {
    "conversation": [(5.0, 8.0), (30.0, 8.0)],
    "synthetic": [(30.0, 2.5)],
}
# the grid tuned on the training slices: weight x follow-up load, its time constant (s)
GRID: dict[str, dict[str, float]] = {
    "w 0.25": {"future_weight": 0.25},
    "w 0.5": {"future_weight": 0.5},
    "w 1": {"future_weight": 1.0},
    "w 2": {"future_weight": 2.0},
    "w 1, tau 10 s": {"future_weight": 1.0, "future_tau_s": 10.0},
    "w 1, tau 90 s": {"future_weight": 1.0, "future_tau_s": 90.0},
}
# the best other policies at these points in goodput-curves.md / deferral.md, and the best-hit ones
BASELINES: dict[str, list[str]] = {
    "conversation": ["prefix_only", "dynamo_cost", "sglang_cache_aware"],
    "synthetic": ["sglang_cache_aware", "prefix_only"],
}
MODES = L.MODES
FOLLOW_SHARE = 0.25  # a request continuing more than this share of its prompt beyond the common prefix

DISCUSSION = """## Discussion

(hand-written; kept when the command regenerates the block above)
"""


def params(setting: str | None, defer: str | None) -> dict[str, Any]:
    return {**(GRID[setting] if setting else {}), **L.params(0.0, defer)}


def follow_ups(w: Workload) -> dict[str, str]:
    """Request id suffix ("r<index>") of each follow-up -> that of the latest earlier request
    sharing its longest prefix, from the trace's 512-token blocks: a follow-up continues more
    than FOLLOW_SHARE of its prompt beyond the prefix common to many requests (a system prompt
    held by more than a tenth of them)."""
    count: Counter[tuple[int, ...]] = Counter()
    for r in w.requests:
        for k in range(1, len(r.hash_ids) + 1):
            count[r.hash_ids[:k]] += 1
    common_min = max(2, len(w.requests) // 10)
    last: dict[tuple[int, ...], str] = {}
    out = {}
    for r in sorted(w.requests, key=lambda x: x.arrival_s):
        ids, common, longest, src = r.hash_ids, 0, 0, None
        for k in range(1, len(ids) + 1):
            if count[ids[:k]] >= common_min:
                common = k
            if ids[:k] in last:
                longest, src = k, last[ids[:k]]
        if src is not None and (longest - common) > FOLLOW_SHARE * len(ids):
            out[f"r{r.index}"] = src
        for k in range(1, len(ids) + 1):
            last[ids[:k]] = f"r{r.index}"
    return out


def follow_up_stats(run_dir: Path, follow: dict[str, str], slo: SLO) -> dict[str, Any]:
    """Attainment of follow-ups and of new requests in one run, and the share of completed
    follow-ups whose earlier request (completed) was prefilled on the same instance."""
    with open(run_dir / "requests.jsonl") as f:
        recs = [RequestRecord.from_dict(json.loads(line)) for line in f]
    rs = {r.request_id.rsplit("-", 1)[-1]: r for r in recs}
    met = {k: r.meets(slo) for k, r in rs.items()}
    fu = [k for k in rs if k in follow]
    new = [k for k in rs if k not in follow]
    pairs = [(rs[k], rs[follow[k]]) for k in fu if follow[k] in rs and rs[k].status == "ok"
             and rs[follow[k]].status == "ok"]
    mean = C.mean
    return {"follow_ups": len(fu), "follow_met": sum(met[k] for k in fu) / max(1, len(fu)),
            "new": len(new), "new_met": sum(met[k] for k in new) / max(1, len(new)),
            "follow_refused": sum(rs[k].status == "rejected" for k in fu) / max(1, len(fu)),
            "pulled": sum(bool(r.transfer_tokens) for r in recs if r.status == "ok"),
            "follow_ttft": mean([rs[k].ttft_s for k in fu if rs[k].status == "ok"]),
            "new_ttft": mean([rs[k].ttft_s for k in new if rs[k].status == "ok"]),
            "new_queue": mean([rs[k].predicted_queue_s for k in new if rs[k].status == "ok"]),
            "same_instance": sum(a.prefill_instance == b.prefill_instance for a, b in pairs) / max(1, len(pairs)),
            "pairs": len(pairs)}


def prepare(name: str, a: argparse.Namespace) -> dict[str, Any]:
    spec, train_w, eval_w, out, model_dir = B.calibrated_world(name, a, PAGE)
    tuning = L.tune(name, a, train_w, spec, str(model_dir), out / "tuning.json", POINTS[name], ["off", *GRID],
                    lambda g, d: params(None if g == "off" else g, d), {"grid": GRID}, a.setting is None)
    return {"name": name, "spec": spec, "eval_w": eval_w, "model_dir": str(model_dir), "tuning": tuning, "out": out,
            "train": len(train_w.requests)}


def mean_attainment(prepared: list[dict[str, Any]], mode: str, setting: str) -> float:
    return statistics.mean(r[setting]["slo_attainment"] for p in prepared for r in p["tuning"][mode].values())


def choose(prepared: list[dict[str, Any]], mode: str) -> str:
    """The setting with the best mean training attainment over every point (ties: the first of
    the grid); evaluated whether or not it beats off (the training table says whether it did)."""
    score = {g: round(mean_attainment(prepared, mode, g), 6) for g in GRID}
    return max(GRID, key=lambda g: (score[g], -list(GRID).index(g)))


def conductor_runs(setting: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Label -> (grid setting or None, deferral setting) of the conductor runs at each point."""
    out = {}
    for mode, d in MODES.items():
        suffix = "" if d is None else " + defer"
        out[f"conductor{suffix}"] = {"setting": None, "defer": d}
        out[f"conductor future {setting[mode]}{suffix}"] = {"setting": setting[mode], "defer": d}
    return out


def evaluate(p: dict[str, Any], a: argparse.Namespace, setting: dict[str, str]) -> dict[str, Any]:
    """Each point in turn, its summaries kept in out/.../ttft<S>-<load>/point.json and reused by
    --reuse-models (a long run can be resumed)."""
    name, w, spec = p["name"], p["eval_w"], p["spec"]
    cap = load_profile(spec.profile).kv_capacity_tokens * spec.prefill
    bound = reuse_bound(w, spec.block_size, cap, "chat", salt="sim-0")
    follow = follow_ups(w)
    mine = conductor_runs(setting)
    points = []
    for ttft, load in POINTS[name]:
        out = p["out"] / f"ttft{ttft:g}-{load:g}"
        cache, key = out / "point.json", {"setting": setting, "baselines": BASELINES[name], "eval": len(w.requests)}
        if a.reuse_models and cache.exists() and json.loads(cache.read_text())["key"] == key:
            pt = json.loads(cache.read_text())["point"]
        else:
            pt = L.run_point(p, a, ttft, load, {k: params(v["setting"], v["defer"]) for k, v in mine.items()},
                             BASELINES[name])
            C.save_json(cache, {"key": key, "point": pt})
        slo = SLO(ttft, a.slo_tbt_ms / 1000)  # read from the runs' records (full outputs) each time
        pt["follow"] = {k: follow_up_stats(out / L.slug(k), follow, slo) for k in pt["runs"]}
        points.append(pt)
        print(f"  {name} {ttft:g}s {load:g}: " + ", ".join(
            f"{k} {v['slo_attainment']:.3f}/{v['hit_ratio']:.3f}" for k, v in pt["runs"].items()),
            file=sys.stderr, flush=True)
    return {"workload": name, "train": p["train"], "eval": len(w.requests), "tuning": p["tuning"],
            "reuse_bound": bound, "follow_ups": len(follow), "points": points}


def render(results: list[dict[str, Any]], setting: dict[str, str], a: argparse.Namespace, command: str) -> str:
    mine, attain, hits, paired, trows = L.tables(results)
    frows = []
    for r in results:
        for pt in r["points"]:
            lbl = (f"{pt['ttft_s']:g} s", G.load_label(r["workload"], pt["load"]))
            for k, f in pt["follow"].items():
                frows.append([r["workload"], *lbl, f"**{k}**" if k.startswith("conductor") else k,
                              f"{C.pct(f['follow_met'])} (n {f['follow_ups']})",
                              C.pct(f["follow_refused"]), f"{C.pct(f['new_met'])} (n {f['new']})",
                              f"{C.pct(f['same_instance'])} (n {f['pairs']})",
                              C.sec(f["follow_ttft"]), C.sec(f["new_ttft"]), C.sec(f["new_queue"]), f["pulled"]])
    follow = C.md_table(["workload", "TTFT SLO", "load", "run", "follow-ups meeting the SLO", "follow-ups refused",
                         "new requests meeting it",
                         "follow-ups on their earlier request's instance", "TTFT mean (s), follow-ups",
                         "TTFT mean (s), new", "predicted queue mean (s), new",
                         "completed requests that pulled a prefix"], frows)

    def mean(mode: str, g: str) -> float:
        return 100 * statistics.mean(row[g]["slo_attainment"] for r in results for row in r["tuning"][mode].values())
    means = "; ".join(f"{mode}: " + ", ".join(f"{g} {mean(mode, g):.2f}%" for g in ["off", *GRID])
                      for mode in MODES) if trows else ""
    tuning = (C.md_table(["workload (training slice)", "deferral", "TTFT SLO", "load", "off", *GRID], trows)
              + f"\nMean training attainment over the points: {means}.\n" if trows
              else "(not run: the setting was given with --setting)\n")
    bounds = "; ".join(f"{r['workload']} {C.pct(r['reuse_bound']['lru_hit_ratio'])} "
                       f"({r['follow_ups']} follow-ups of {r['eval']})" for r in results)
    return f"""
**Command** (regenerates this block and results.json):

```
{command}
```

**Setup.** Cluster, SLOs, slices and predictors as [deferral.md](deferral.md) ({a.prefill}P+{a.decode}D
`{B.PROFILE}`, TBT <= {a.slo_tbt_ms:g} ms, learned predictors calibrated here again on the first
{results[0]['train']} requests, evaluated on the next {results[0]['eval']}).
"future S" = conductor with the grid setting S (`future_weight` w, `future_tau_s` tau, default 30 s;
`future_new_share` 0.25; scheduler/policies/conductor_future.py): a request whose prefix held by some
instances only is <= 25% of its prompt adds w x each candidate's follow-up load (the prefill seconds of
requests placed there because it held > 25% of their prompt beyond the common prefix, decayed with time
constant tau). Setting tuned on the *training* slices (best mean attainment over every point): without
deferral **{setting['no defer']}**, with it **{setting['defer']}**.
"+ defer" = deferred dispatch with the setting tuned in [deferral.md](deferral.md):
{', '.join(f'{k}={v}' for k, v in L.D.defer_params(L.DEFER).items())}. Baselines (no deferral):
{'; '.join(f"{k}: {', '.join(BASELINES[k])}" for k in POINTS)}; "best other" = the best of them at that
point. Prefix hit = cached / prompt tokens of completed requests; reuse bound = one global LRU of the
prefill instances' KV over the evaluation slice: {bounds}. A follow-up = a request continuing more than
25% of its prompt (trace blocks) beyond the prefix common to a tenth of the slice, from an earlier request.

**SLO attainment** (ratio to the best other policy's at equal offered load = goodput ratio):

{attain}
**Prefix hit** (its ratio to the reuse bound; target: >= the best other's and >= 90% of the bound):

{hits}
**Prefix hit on the requests both completed** (this run vs the baseline with the best hit at that point):

{paired}
**Follow-ups** (the evaluation runs; an earlier request's instance: where the request it continues was
prefilled, both completed; means over completed requests; predicted queue: at the decision, on the
chosen instance):

{follow}
**Tuning** (conductor on the *training* slice; attainment / prefix hit):

{tuning}
""" + L.point_details(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.sim_arguments(p, ",".join(POINTS), workers=1)
    p.add_argument("--reuse-models", action="store_true",
                   help="skip calibration (and tuning, if made by the same grid) when out/experiments/future-value/ "
                        "has it")
    p.add_argument("--setting", choices=list(GRID), default=None, help="skip tuning: evaluate this setting")
    p.add_argument("--tune-only", action="store_true", help="calibrate and tune on the training slices; no evaluation")
    p.add_argument("--from-results", action="store_true", help="re-render the page from its results.json")
    a = p.parse_args()
    if a.from_results:
        saved = json.loads((C.DOCS / PAGE / "results.json").read_text())
        results, command, setting = saved["results"], saved["command"], saved["setting"]
    else:
        prepared = [prepare(n, a) for n in a.workloads.split(",")]
        setting = ({m: a.setting for m in MODES} if a.setting is not None else {m: choose(prepared, m) for m in MODES})
        print(f"setting: {setting}", file=sys.stderr, flush=True)
        if a.tune_only:
            return
        results, command = [evaluate(x, a, setting) for x in prepared], C.command_line()
    C.save_json(C.DOCS / PAGE / "results.json", {"command": command, "profile": B.PROFILE, "prefill": a.prefill,
                                                 "decode": a.decode, "slo_tbt_ms": a.slo_tbt_ms,
                                                 "setting": setting, "results": results})
    C.write_doc(C.DOCS / f"{PAGE}.md", "Future value: placing new conversations by their instances' follow-up load",
                render(results, setting, a, command), DISCUSSION, command)
    print(f"wrote {C.DOCS / PAGE}.md")


if __name__ == "__main__":
    main()
