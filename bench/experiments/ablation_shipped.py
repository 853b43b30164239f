"""The ablation of conductor as shipped: each of its departures from Algorithm 1 turned off alone,
at one load per workload and TTFT SLO where default-wait-room.md reaches 1.2x (issue 15's table).

    .venv/bin/python bench/experiments/ablation_shipped.py --reuse-models --seeds 3 --workers 2

With deferral.md's cluster, calibrated predictors and evaluation slices (8P+8D, TBT <= 200 ms, every
policy admitting against the SLO): conductor with no parameter, then the same with one thing off
(the wait room, its join or its wait for a busy holder; in-flight prefixes; the work term; the
decode choice by earliest first token; the learned predictors, for the analytic prior), then
``conductor_alg1`` (Algorithm 1 as published: every departure off), for seeds 0..N-1, beside the best
other built-in policy per seed as default-wait-room.md recorded it. Writes
docs/experiments/ablation-shipped.md, its figure and results.json; ``--from-results`` re-renders it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import _common as C
import baselines as B
import deferral as D
import overload_admission as O

from predictors.telemetry import SLO  # noqa: E402

PAGE = "ablation-shipped"
SOURCE = "default-wait-room"
SHIPPED_LABEL = "conductor (as shipped)"
# (workload, TTFT SLO, load): per workload and SLO, the load where default-wait-room.md's ratio is highest
POINTS: list[tuple[str, float, float]] = [
    ("conversation", 5.0, 24.0), ("conversation", 30.0, 16.0), ("azure_code", 5.0, 12.0),
    ("azure_code", 30.0, 36.0), ("synthetic", 5.0, 3.5), ("synthetic", 30.0, 3.5)]
# label -> (policy, its parameters, predictors: "learned" or "analytic"); the hypothesis each tests
VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "as shipped": ("conductor", {}, "learned"),
    "no wait room (defer=off)": ("conductor", {"defer": False}, "learned"),
    "room without join": ("conductor", {"defer_join": False}, "learned"),
    "room without waiting for the holder": ("conductor", {"defer_wait_holder": False}, "learned"),
    "no in-flight prefixes (inflight=false)": ("conductor", {"inflight": False}, "learned"),
    "no work term (work_weight=0)": ("conductor", {"work_weight": 0.0}, "learned"),
    "decode by TBT (decode_choice=tbt)": ("conductor", {"decode_choice": "tbt"}, "learned"),
    "analytic predictors": ("conductor", {}, "analytic"),
    "Algorithm 1 (conductor_alg1)": ("conductor_alg1", {}, "learned"),
}


def _run(job: tuple[Any, ...]) -> tuple[float, float]:
    """One simulation's SLO attainment and prefix hit (a worker process)."""
    w, spec, policy, params, load, ttft, tbt_ms, pred, seed = job
    spec = dataclasses.replace(spec, seed=seed)
    summary, _ = O.sweep(w, spec, [policy], load, SLO(ttft, tbt_ms / 1000), pred, params, 1, None, seed=seed,
                         shipped=True)[policy]
    return float(summary["slo_attainment"] or 0.0), float(summary["hit_ratio"] or 0.0)


def recorded() -> dict[tuple[str, float, float], dict[str, Any]]:
    """default-wait-room.md's points: per seed, conductor as shipped and the best other policy."""
    saved = json.loads((C.DOCS / SOURCE / "results.json").read_text())
    out = {}
    for r in saved["results"]:
        for pt in r["points"]:
            others = {p: v for p, v in pt["runs"].items() if p != SHIPPED_LABEL}
            best = [max(others, key=lambda p, i=i: others[p][i]) for i in range(len(pt["runs"][SHIPPED_LABEL]))]
            out[(r["workload"], pt["ttft_s"], pt["load"])] = {
                "shipped": pt["runs"][SHIPPED_LABEL], "best": best,
                "best_runs": [others[p][i] for i, p in enumerate(best)],
                "best_hit": max(statistics.mean(v) for p, v in pt["hits"].items() if p != SHIPPED_LABEL)}
    return out


def evaluate(a: argparse.Namespace) -> list[dict[str, Any]]:
    names = sorted({n for n, _, _ in POINTS})
    worlds = {n: B.calibrated_world(n, a, "deferral") for n in names}
    pts = [p for p in POINTS if p[0] in a.workloads.split(",")]
    jobs = []
    for name, ttft, load in pts:
        spec, _, w, _, model_dir = worlds[name]
        jobs += [(w, spec, pol, params, load, ttft, a.slo_tbt_ms, str(model_dir) if pred == "learned" else pred, seed)
                 for pol, params, pred in VARIANTS.values() for seed in range(a.seeds)]
    with ProcessPoolExecutor(a.workers) as ex:
        res = iter(ex.map(_run, jobs))
    rec = recorded()
    out = []
    for name, ttft, load in pts:
        runs = {label: [next(res) for _ in range(a.seeds)] for label in VARIANTS}
        r = rec[(name, ttft, load)]
        row = {"workload": name, "ttft_s": ttft, "load": load,
               "attainment": {k: [x[0] for x in v] for k, v in runs.items()},
               "hit": {k: [x[1] for x in v] for k, v in runs.items()},
               "recorded_shipped": r["shipped"][:a.seeds], "best": r["best"][:a.seeds],
               "best_runs": r["best_runs"][:a.seeds], "best_hit": r["best_hit"]}
        print(f"  {name} {ttft:g}s {load:g}: " + ", ".join(
            f"{k} {statistics.mean(v):.3f}" for k, v in row["attainment"].items()), file=sys.stderr, flush=True)
        out.append(row)
    return out


def _where(r: dict[str, Any]) -> str:
    return f"{r['workload']} {r['ttft_s']:g} s, {D.load_label(r['workload'], r['load'])}"


def render(results: list[dict[str, Any]], command: str, seeds: int) -> str:
    heads = ["variant", *(_where(r) for r in results)]
    rows = []
    for label in VARIANTS:
        cells = []
        for r in results:
            m, base = statistics.mean(r["attainment"][label]), statistics.mean(r["attainment"]["as shipped"])
            best = statistics.mean(r["best_runs"])
            ratio = statistics.mean(x / b for x, b in zip(r["attainment"][label], r["best_runs"], strict=True))
            cells.append(f"{C.pct(m)} ({'' if label == 'as shipped' else f'{100 * (m - base):+.1f}, '}"
                         f"{ratio:.2f}x)" if best else C.pct(m))
        rows.append([label, *cells])
    rows.append(["best other (recorded per seed)",
                 *(f"{C.pct(statistics.mean(r['best_runs']))} ({', '.join(sorted(set(r['best'])))})" for r in results)])
    rows.append(["check: as shipped, recorded", *(C.pct(statistics.mean(r["recorded_shipped"])) for r in results)])
    reuse = [r for r in results if r["workload"] != "azure_code"]
    hit_rows = [[label, *(C.pct(statistics.mean(r["hit"][label])) for r in reuse)] for label in VARIANTS]
    hit_rows.append(["the other policy with the most (recorded)", *(C.pct(r["best_hit"]) for r in reuse)])
    return f"""**Command** (regenerates this block, the figure and results.json):

```
{command}
```

**Setup.** deferral.md's cluster, calibrated predictors and evaluation slices (8P+8D
`llama3-70b-a800x8-gap`, TBT <= 200 ms, every policy admitting against the SLO with the same learned
predictors), one load per workload and TTFT SLO (where default-wait-room.md's ratio is highest),
{C.seeds_label(seeds)}. Each row turns one of conductor's departures from Algorithm 1 off and keeps the rest
as shipped; "Algorithm 1" turns them all off (`conductor_alg1`, which has no wait room). Each
cell: SLO attainment (mean over the seeds), then its change from as shipped in points and the mean
per-seed ratio to the best other built-in policy (= goodput ratio at equal load). The last rows:
the best other per seed and conductor as shipped, as default-wait-room.md recorded them.

{C.md_table(heads, rows)}

Prefix hit (prompt tokens served from cache over the completed requests, mean over the seeds) at
the points with reuse:

{C.md_table(["variant", *(_where(r) for r in reuse)], hit_rows)}

![attainment per variant and point](ablation-shipped/attainment.png)
"""


def figure(results: list[dict[str, Any]], dpi: int = 110) -> None:
    """Grouped bars: each variant's attainment at each point, the best other beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [*VARIANTS, "best other"]
    fig, ax = plt.subplots(figsize=(12, 5.6))
    width = 0.8 / len(labels)
    for k, label in enumerate(labels):
        ys = [statistics.mean(r["best_runs"] if label == "best other" else r["attainment"][label]) for r in results]
        ax.bar([i + (k - len(labels) / 2) * width + width / 2 for i in range(len(results))], ys, width,
               label=label, color="black" if label == "best other" else None)
    ax.set_xticks(range(len(results)), [_where(r) for r in results], fontsize=8)
    ax.set_ylabel("SLO attainment (mean over seeds)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.set_title("conductor as shipped, each departure from Algorithm 1 off alone (8P+8D, simulated)")
    C.save_figure(fig, C.DOCS / PAGE / "attainment.png", dpi)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = C.seeded_arguments(p, ",".join(sorted({n for n, _, _ in POINTS})))
    bad = [n for n in a.workloads.split(",") if n not in {m for m, _, _ in POINTS}]
    if bad and not a.from_results:
        p.error(f"--workloads: unknown {', '.join(bad)} (conversation, azure_code, synthetic)")
    figure(C.seeded_page(PAGE, "The ablation of conductor as shipped", a, lambda: evaluate(a), render))


if __name__ == "__main__":
    main()
