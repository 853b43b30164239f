"""Peer pulls: conductor with prefill instances that can fetch a prefix from another prefill
instance (Mooncake's transfer engine; issue 15's last hypothesis, "no store, no peer pulls").

    .venv/bin/python bench/experiments/peer_pull.py --reuse-models --workers 1 [--from-results]

At deferral.md's points on the workloads with prefix reuse (the Azure code trace has none: its
prefix hit is 0, so nothing can be pulled), with deferral.md's calibrated models
(out/experiments/deferral/<workload>/models; calibrated there when missing): conductor and conductor
+ the tuned deferral with peer pulls off (as deferral.md) and on (``ClusterSpec.peer_pull``: the
policy plans pulls from a peer, the simulated engines run them), and the best other policy of
deferral.md at that point with and without deferral (it plans no pull, so peer pulls change
nothing for it), all rerun here; and conductor with pulls again with predictors calibrated the
same way on telemetry in which conductor pulls (out/experiments/peer-pull/<workload>/models-pull).
Beside them the reuse bound: one LRU over the prefill instances' KV, replaying the slice. Each
run's summary is kept in out/experiments/peer-pull/ and reused with --reuse-models. Writes
docs/experiments/peer-pull.md (+ results.json).
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
import deferral_store as S

from engines_adapters.sim.profiles import load_profile  # noqa: E402
from loadgen.simulate.reuse import reuse_bound  # noqa: E402
from predictors.calibrate import calibrate  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402

PAGE = "peer-pull"
POINTS: dict[str, list[tuple[float, float]]] = {
    "conversation": [(5.0, 8.0), (30.0, 8.0), (30.0, 12.0), (30.0, 16.0)],
    "synthetic": [(30.0, 2.5), (30.0, 3.5)],
}
RUNS = ["conductor", "conductor + pull", "conductor + defer", "conductor + defer + pull", "best other",
        "best other + defer", "conductor + pull (pull-calibrated)", "conductor + defer + pull (pull-calibrated)"]


def best_others(name: str) -> dict[tuple[float, float], str]:
    saved = json.loads((C.DOCS / "deferral" / "results.json").read_text())
    return {(pt["ttft_s"], pt["load"]): pt["best"] for r in saved["results"] if r["workload"] == name
            for pt in r["points"]}


def late(requests: Path, ttft_s: float) -> dict[str, int]:
    """Admitted requests whose TTFT missed the SLO, and of those the ones that pulled from a peer."""
    recs = [json.loads(x) for x in requests.read_text().splitlines() if x.strip()]
    missed = [r for r in recs if r["status"] == "ok" and r["ttft_s"] is not None and r["ttft_s"] > ttft_s]
    return {"ttft": len(missed), "pulled": sum(r["transfer_from"] not in (None, "store") for r in missed)}


def evaluate(name: str, a: argparse.Namespace) -> dict[str, Any]:
    spec, train_w, w, _, model_dir = B.calibrated_world(name, a, "deferral")  # deferral.md's predictors
    pull = dataclasses.replace(spec, peer_pull=True)
    pull_models = C.OUT / PAGE / name / "models-pull"  # the same calibration, its telemetry with peer pulls
    if not (a.reuse_models and (pull_models / "models.json").exists()):
        calibrate(B.telemetry(train_w, pull, SLO(5.0, a.slo_tbt_ms / 1000), B.TRAIN_LOADS[name]), str(pull_models),
                  holdout="random", draw=False)
    cap = load_profile(spec.profile).kv_capacity_tokens * spec.prefill
    bound = reuse_bound(w, spec.block_size, cap, "chat", salt="sim-0")
    best, points = best_others(name), []
    for ttft, load in POINTS[name]:
        out = C.OUT / PAGE / name / f"ttft{ttft:g}-{load:g}"
        other = best[(ttft, load)]
        runs = {}
        for label in RUNS:
            policy = other if label.startswith("best other") else "conductor"
            defer = S.DEFER if "+ defer" in label else None
            on, recal = "+ pull" in label, label.endswith("(pull-calibrated)")
            path = out / label.replace(" + ", "-").replace(" (pull-calibrated)", "-recal").replace(" ", "_")
            v = runs[label] = S.cached_run(a, w, pull if on else spec, policy, (ttft, load),
                                           str(pull_models if recal else model_dir), defer, path,
                                           peer_pull="on" if on else "off", models="pull" if recal else "deferral")
            v["late"] = late(path / "requests.jsonl", ttft)
            print(f"  {name} {ttft:g}s {load:g}: {label} ({policy}) {v['slo_attainment']:.3f} hit {v['hit_ratio']:.3f} "
                  f"peer-pulled {v['transfers']['peer_tokens']}", file=sys.stderr, flush=True)
        points.append({"ttft_s": ttft, "load": load, "best": other, "runs": runs})
    return {"workload": name, "eval": len(w.requests), "reuse_bound": bound, "points": points}


def render(results: list[dict[str, Any]], a: Any, command: str) -> str:
    rows, hrows = [], []
    for r in results:
        for pt in r["points"]:
            runs = pt["runs"]
            att = {k: v["slo_attainment"] or 0 for k, v in runs.items()}
            bo, bd = att["best other"], max(att["best other"], att["best other + defer"])
            lbl = [r["workload"], f"{pt['ttft_s']:g} s", D.load_label(r["workload"], pt["load"])]
            cd, cdp = att["conductor + defer"], att["conductor + defer + pull"]
            cdr = att["conductor + defer + pull (pull-calibrated)"]
            rows.append([*lbl, f"{pt['best']} {C.pct(bo)} / {C.pct(att['best other + defer'])}",
                         *(C.pct(att[k]) for k in RUNS[:4]),
                         f"{100 * (att['conductor + pull'] - att['conductor']):+.1f}",
                         f"{100 * (att['conductor + defer + pull'] - att['conductor + defer']):+.1f}",
                         C.pct(att["conductor + pull (pull-calibrated)"]), C.pct(cdr),
                         f"{cd / max(bo, 1e-9):.2f}x / {cd / max(bd, 1e-9):.2f}x",
                         f"**{cdp / max(bo, 1e-9):.2f}x** / {cdp / max(bd, 1e-9):.2f}x",
                         f"**{cdr / max(bo, 1e-9):.2f}x** / {cdr / max(bd, 1e-9):.2f}x"])
            for k in RUNS:
                v, t = runs[k], runs[k]["transfers"]
                hrows.append([*lbl, f"**{k}**" if k.startswith("conductor") else f"{k} ({pt['best']})",
                              C.pct(v["slo_attainment"]), C.pct(v["hit_ratio"]),
                              C.pct(t["peer_tokens"] / max(t["prompt_tokens"], 1)), v["rejected"],
                              v["late"]["ttft"], v["late"]["pulled"]])
    summary = C.md_table(["workload", "TTFT SLO", "load", "best other / + defer", "conductor", "+ pull",
                          "conductor + defer", "+ pull", "pull gain (points)", "pull gain with defer (points)",
                          "conductor + pull, pull-calibrated", "conductor + defer + pull, pull-calibrated",
                          "conductor + defer / best other (/ incl. + defer)",
                          "with pulls / best other (/ incl. + defer)", "with pulls, pull-calibrated / best other "
                          "(/ incl. + defer)"], rows)
    hits = C.md_table(["workload", "TTFT SLO", "load", "run", "attainment", "prefix hit",
                       "peer-pulled (planned, share of prompt tokens)", "refused", "admitted and late (TTFT)",
                       "pulled and late"], hrows)
    bounds = "; ".join(f"{r['workload']} {C.pct(r['reuse_bound']['lru_hit_ratio'])} "
                       f"(unbounded cache {C.pct(r['reuse_bound']['infinite_hit_ratio'])})" for r in results)
    return f"""
**Command** (regenerates this block and results.json):

```
{command}
```

**Setup.** As [deferral.md](deferral.md) ({a.prefill}P+{a.decode}D `{B.PROFILE}`, TBT <= {a.slo_tbt_ms:g} ms,
its learned predictors: calibrated on the first {a.train} requests, no store, no peer pulls; evaluation on the
next {results[0]['eval']}), every run here. "+ pull" = `ClusterSpec.peer_pull` (`conductor simulate
--peer-pull`): conductor's Algorithm 1 pull branch may plan to fetch the longest prefix from the prefill
instance holding it (`peer_pull=True`, the direct rule: when the predicted transfer is shorter than the
prefill it saves), and the simulated prefill engine loads the blocks that instance still holds at dispatch,
beyond its own, at the network bandwidth before computing the rest. "+ defer" = deferral.md's tuned
setting ({', '.join(f'{k}={v}' for k, v in D.defer_params(S.DEFER).items())}). Best other = deferral.md's
best other policy at that point, rerun (it plans no pull: peer pulls cannot change it).
"Pull-calibrated" = the same calibration (training slice, loads, conductor with analytic predictors)
on a cluster with peer pulls, so the learned terms have seen pulled requests. Ratios are
attainment ratios at equal offered load (= goodput ratios). The Azure code trace has no prefix reuse
(prefix hit 0 for every policy in deferral.md), so there is nothing to pull; it is left out.

**SLO attainment:**

{summary}
**Per run** (prefix hit = cached / prompt tokens of completed requests, as the engines report, pulled blocks
included; peer-pulled = the tokens the decisions planned to pull from a peer, over the completed requests'
prompt tokens). Reuse bound (the share of prompt tokens one LRU over all {a.prefill} prefill instances' KV
would hit, replaying the slice in order): {bounds}.

{hits}"""


DISCUSSION = """## Discussion

Peer pulls change conductor's attainment by a few points either way at these points: the block's
"pull gain" columns. Why, run by run, is written here by hand after each run (late admissions,
prefix hit against the reuse bound, the pulled requests' TTFT prediction error).
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.sim_arguments(p, ",".join(POINTS))
    p.add_argument("--reuse-models", action="store_true",
                   help="reuse deferral.md's calibrated models and this page's stored runs when they exist")
    p.add_argument("--from-results", action="store_true", help="re-render the page from its results.json")
    a = p.parse_args()
    if a.from_results:
        saved = json.loads((C.DOCS / PAGE / "results.json").read_text())
        results, command = saved["results"], saved["command"]
    else:
        results = [evaluate(n, a) for n in a.workloads.split(",") if n in POINTS]
        command = C.command_line()
        C.save_json(C.DOCS / PAGE / "results.json", {"command": command, "profile": B.PROFILE, "results": results})
    C.write_doc(C.DOCS / f"{PAGE}.md", "Peer pulls: a prefill instance fetching a prefix from another",
                render(results, a, command), DISCUSSION, command)
    print(f"wrote {C.DOCS / PAGE}.md")


if __name__ == "__main__":
    main()
