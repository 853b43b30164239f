"""Where conductor's prefix hit stands against the policy with the most, once both are measured on
the same requests (issue 15's prefix-hit target, at default-wait-room.md's points with reuse).

    .venv/bin/python bench/experiments/hit_composition.py --reuse-models --seeds 5 --workers 2

A hit ratio is over the requests a run completed, and under an SLO that binds each policy completes
a different set: conductor completes more, among them requests the others refuse. At each point
with reuse: conductor as shipped and the other policy with the most hit (default-wait-room.md), on
the same seeds; their hit on the requests both completed and on those only one did (paired_hits.py's
comparison, for conductor as shipped, in runs of its own); and the reuse
bound twice: the trace's (goodput-curves.md: one global LRU fed every request) and the same LRU fed
only the requests that policy completed (``loadgen.simulate.reuse.served_bound``, what
``conductor simulate --reuse-bound`` now reports per policy). Writes docs/experiments/hit-composition.md
(+ results.json); ``--from-results`` re-renders it.
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
import paired_hits as P
import seeds as S

from engines_adapters.sim.profiles import load_profile  # noqa: E402
from loadgen.simulate.reuse import completed, served_bound  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402

PAGE = "hit-composition"
SOURCE = "default-wait-room"  # its points, and which other policy had the most hit at each
SHIPPED = "conductor"


def _run(job: tuple[Any, ...]) -> dict[str, Any]:
    """One simulation: its hit, the cached / prompt tokens of each completed request (by trace
    index), and the LRU bound over just those (a worker process)."""
    w, spec, policy, load, ttft, tbt_ms, model_dir, seed = job
    spec = dataclasses.replace(spec, seed=seed)
    summary, recs = O.sweep(w, spec, [policy], load, SLO(ttft, tbt_ms / 1000), model_dir, {}, 1, None, seed=seed,
                            shipped=True)[policy]
    done = completed(recs)
    cap = load_profile(spec.profile).kv_capacity_tokens * spec.prefill
    total, hit = served_bound(w, done, spec.block_size, cap, "chat", salt=f"sim-{seed}")
    tokens = {int(r.extra["trace_index"]): {"cached_tokens": r.cached_tokens, "prompt_tokens": r.prompt_tokens}
              for r in recs if r.status == "ok" and r.cached_tokens is not None}
    return {"hit": float(summary["hit_ratio"] or 0.0), "attainment": float(summary["slo_attainment"] or 0.0),
            "tokens": tokens, "served_bound": hit / total if total else None}


def pair(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Both runs' hit on the requests both completed, and on those only one did."""
    a, b = mine["tokens"], theirs["tokens"]
    both = a.keys() & b.keys()
    return {"both": len(both), "ours_both": P.hit([a[k] for k in both]), "theirs_both": P.hit([b[k] for k in both]),
            "ours_only": len(a) - len(both), "ours_only_hit": P.hit([a[k] for k in a.keys() - both]),
            "theirs_only": len(b) - len(both), "theirs_only_hit": P.hit([b[k] for k in b.keys() - both])}


def points(name: str) -> list[dict[str, Any]]:
    """The source page's points of this workload, each with the other policy of most mean hit."""
    saved = json.loads((C.DOCS / SOURCE / "results.json").read_text())
    out = []
    for r in saved["results"]:
        if r["workload"] != name:
            continue
        for pt in r["points"]:
            others = {k: statistics.mean(v) for k, v in pt["hits"].items() if k != "conductor (as shipped)"}
            out.append({"ttft_s": pt["ttft_s"], "load": pt["load"], "rival": max(others, key=others.__getitem__),
                        "page_hit": statistics.mean(pt["hits"]["conductor (as shipped)"])})
    return out


def evaluate(name: str, a: argparse.Namespace) -> list[dict[str, Any]]:
    spec, _, w, _, model_dir = B.calibrated_world(name, a, "deferral")
    pts = points(name)
    jobs = [(w, spec, pol, pt["load"], pt["ttft_s"], a.slo_tbt_ms, str(model_dir), seed)
            for pt in pts for pol in (SHIPPED, pt["rival"]) for seed in range(a.seeds)]
    with ProcessPoolExecutor(a.workers) as ex:
        res = iter(ex.map(_run, jobs))
    out = []
    for pt in pts:
        ours, theirs = [next(res) for _ in range(a.seeds)], [next(res) for _ in range(a.seeds)]
        pairs = [pair(x, y) for x, y in zip(ours, theirs, strict=True)]
        row = {**pt, "seeds": a.seeds,
               **{f"{who}_{k}": [r[k] for r in runs] for who, runs in (("ours", ours), ("theirs", theirs))
                  for k in ("hit", "attainment", "served_bound")},
               "pairs": pairs}
        print(f"  {name} {pt['ttft_s']:g}s {pt['load']:g}: hit {C.mean(row['ours_hit']):.3f} vs {pt['rival']} "
              f"{C.mean(row['theirs_hit']):.3f}; on both {C.mean([p['ours_both'] for p in pairs]):.3f} vs "
              f"{C.mean([p['theirs_both'] for p in pairs]):.3f}", file=sys.stderr, flush=True)
        out.append(row)
    return out


def render(results: list[dict[str, Any]], command: str, seeds: int) -> str:
    bound = S.reuse_bounds()
    hit_rows, bound_rows = [], []
    for r in results:
        name = r["workload"]
        for pt in r["points"]:
            where = [name, f"{pt['ttft_s']:g} s", D.load_label(name, pt["load"])]
            ps = pt["pairs"]
            ours, theirs = C.mean(pt["ours_hit"]), C.mean(pt["theirs_hit"])
            ob, tb = C.mean([p["ours_both"] for p in ps]), C.mean([p["theirs_both"] for p in ps])
            hit_rows.append([*where, pt["rival"], f"{C.pct(ours)} / {C.pct(theirs)}",
                             "yes" if ours >= theirs else "**no**",
                             f"{C.mean([p['both'] for p in ps]):.0f}", f"**{C.pct(ob)}** / {C.pct(tb)}",
                             "yes" if ob >= tb else "**no**",
                             f"{C.mean([p['ours_only'] for p in ps]):.0f}: "
                             f"{C.pct(C.mean([p['ours_only_hit'] for p in ps]))}",
                             f"{C.mean([p['theirs_only'] for p in ps]):.0f}: "
                             f"{C.pct(C.mean([p['theirs_only_hit'] for p in ps]))}"])
            b, osb, tsb = bound[name], C.mean(pt["ours_served_bound"]), C.mean(pt["theirs_served_bound"])
            bound_rows.append([*where, C.pct(b), f"{C.pct(ours)}: {ours / b:.2f}",
                               f"{C.pct(osb)}: **{ours / osb:.2f}**",
                               f"{pt['rival']} {C.pct(theirs)}: {theirs / b:.2f} / {theirs / tsb:.2f}"])
    return f"""**Command** (regenerates this block and results.json):

```
{command}
```

**Setup.** default-wait-room.md's points with reuse (8P+8D `llama3-70b-a800x8-gap`, calibrated
predictors, the evaluation slices, TBT <= 200 ms, every policy admitting against the SLO),
{C.seeds_label(seeds)}: conductor as shipped against the other built-in policy with
the most prefix hit there. Hit: prompt tokens served from cache over prompt tokens, on the requests each run completed
(the engines' figure); means over the seeds. Requests are matched by their trace index within a seed.

**The same requests.** "completed by both": the requests both runs completed (mean count per seed),
and each policy's hit on them. "only conductor" / "only the other": how many requests one completed
and the other did not, and the hit on them.

{C.md_table(["workload", "TTFT SLO", "load", "the other", "hit: conductor / the other",
             "at least as much", "completed by both", "hit on them: conductor / the other", "at least as much",
             "only conductor: n, hit", "only the other: n, hit"], hit_rows)}

**The reuse bound, twice.** "trace": goodput-curves.md's one global LRU of the prefill instances'
KV, fed every request of the slice (seed 0). "its completed": the same LRU fed only the requests the
run completed, per seed. Each cell: the hit, then hit / bound (issue 15 asks 0.9).

{C.md_table(["workload", "TTFT SLO", "load", "trace bound", "conductor: hit / trace bound",
             "conductor's completed: bound, hit / bound", "the other: hit / trace bound / its completed"],
            bound_rows)}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = C.seeded_arguments(p, "conversation,synthetic")
    bound, names = S.reuse_bounds(), a.workloads.split(",")
    bad = [n for n in names if n not in bound or bound[n] < S.NO_REUSE]
    if bad and not a.from_results:
        p.error(f"--workloads: {', '.join(bad)}: not a workload with reuse (conversation, synthetic)")
    C.seeded_page(PAGE, "conductor's prefix hit on the same requests", a,
                  lambda: [{"workload": n, "points": evaluate(n, a)} for n in names], render)


if __name__ == "__main__":
    main()
