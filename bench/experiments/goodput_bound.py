"""Goodput ceiling: the SLO attainment no policy could exceed at each point of goodput-curves.md,
and hence the largest ratio any policy could have over the measured best other (issue 15's 1.2x).

    .venv/bin/python bench/experiments/goodput_bound.py [--noise-z 4] [--slots-per-slo 20]

Reads goodput_curves.py's evaluation slices, loads and SLOs (the same ``baselines.slices``, the
simulator's prompt synthesis and salt) and the measured attainments of its results.json; per point
solves the relaxation of loadgen/simulate/bound.py (per-request least TTFT by the engine's own
timing, unbounded prefix reuse, a pooled preemptive slot LP for the prefill instances' capacity)
twice: for the engine's mean step times, and with every step ``--noise-z`` standard deviations of
the engine's noise faster. Writes docs/experiments/goodput-bound.md and goodput-bound/results.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any

import _common as C
import baselines as B
import goodput_curves as G

from engines_adapters.sim.profiles import load_profile  # noqa: E402
from loadgen.arrivals import sped_up  # noqa: E402
from loadgen.simulate.bound import attainment_bound, engine_sigma  # noqa: E402
from loadgen.simulate.reuse import prompt_blocks  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402

PAGE = "goodput-bound"
TARGET = 1.2  # issue 15: conductor >= 1.2x the best other policy

DISCUSSION = """## Discussion

(hand-written; kept when the command regenerates the block above)
"""


def verdict(mean_ceiling: float, noisy_ceiling: float) -> str:
    if noisy_ceiling < TARGET:
        return "**impossible**"
    if mean_ceiling < TARGET:
        return "impossible at mean step times"
    return "not excluded"


def check(a: argparse.Namespace, spec: Any, w: Any, pt: dict[str, Any], tbt_s: float,
          bounds: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Soundness against real runs: simulate ``--check`` policies (oracle predictors, admitting
    against the SLO) on slice ``w`` (sped up by the sweep) at the point; no request's TTFT may be
    below its least TTFT, no run's attainment above the bound."""
    slo = SLO(pt["ttft_s"], tbt_s)
    o = C.sweep(w, spec, a.check.split(","), loads=[pt["load"]], metric_slo=slo, admission_slo=slo,
                predictors="oracle", workers=a.workers)
    where = {q.index: i for i, q in enumerate(w.requests)}
    out = []
    for step in o.steps:
        done = [(r.ttft_s, where[int(r.request_id.rsplit("-r", 1)[1])]) for r in step.records if r.ttft_s is not None]
        least = {k: b["least_ttft_s"] for k, b in bounds.items()}
        out.append({"policy": step.policy, "served": len(done),
                    "ttft_attainment": sum(r.meets(SLO(pt["ttft_s"], None)) for r in step.records) / len(w.requests),
                    "attainment": sum(r.meets(slo) for r in step.records) / len(w.requests),
                    "min_ttft_over_least": min((t / least["mean"][i] for t, i in done), default=None),
                    "below_least": {k: int(sum(t < v[i] for t, i in done)) for k, v in least.items()}})
    return out


def headroom(r: dict[str, Any]) -> str:
    """(conductor - best other) / (bound - best other): how much of what any policy could add over
    the best other conductor took ("-" when the best other is at the bound)."""
    room = r["mean"]["attainment_bound"] - r["best_attainment"]
    return f"{(r['conductor'] - r['best_attainment']) / room:.0%}" if room > 0.005 else "-"


def accountings(b: dict[str, Any]) -> str:
    """The two accountings' bounds (bound.py), the lower in bold; '-' without shared prefixes."""
    acc = b.get("accounting", {})
    if len(acc) < 2:
        return "-"
    first, once = acc["first_holder"], acc["paid_once"]

    def show(v: float, other: float) -> str:
        return f"**{C.pct(v)}**" if v < other else C.pct(v)
    return f"{show(first, once)} / {show(once, first)}"


def bounds_at(w: Any, spec: Any, profile: Any, blocks: list[Any], load: float, ttft_s: float, prefill: int,
              noise_z: float, slots_per_slo: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The bound at one load and TTFT SLO: at the engine's mean step times, and with every step
    ``noise_z`` standard deviations of its noise faster."""
    arrivals = [q.arrival_s for q in sped_up(w, load).requests]
    kw = dict(prefill=prefill, ttft_s=ttft_s, block_size=spec.block_size, budget=spec.engine["max_num_batched_tokens"],
              noise_sigma=engine_sigma(profile, spec.noise), slots_per_slo=slots_per_slo)
    return (attainment_bound(arrivals, blocks, profile, noise_z=0.0, **kw),
            attainment_bound(arrivals, blocks, profile, noise_z=noise_z, **kw))


def bound_points(a: argparse.Namespace, measured: dict[str, Any]) -> list[dict[str, Any]]:
    profile = load_profile(measured["profile"])
    spec = dataclasses.replace(C.cluster(measured["prefill"], measured["decode"]), profile=measured["profile"])
    out = []
    for r in measured["results"]:
        name = r["workload"]
        if name not in a.workloads.split(","):
            continue
        _, w = B.slices(name, r["train"], r["eval"])
        t = time.perf_counter()
        blocks = list(prompt_blocks(w, spec.block_size, "chat", "sim-0"))  # as run_sweep's salt (seed 0)
        print(f"== {name}: {len(blocks)} evaluation prompts hashed in {time.perf_counter() - t:.1f} s",
              file=sys.stderr, flush=True)
        for pt in r["points"]:
            mean, noisy = bounds_at(w, spec, profile, blocks, pt["load"], pt["ttft_s"], measured["prefill"],
                                    a.noise_z, a.slots_per_slo)
            runs = pt["runs"]
            best = runs[pt["best"]]["slo_attainment"]
            row = {"workload": name, "ttft_s": pt["ttft_s"], "load": pt["load"],
                   "load_label": G.load_label(name, pt["load"]), "offered_rps": r["offered_rps_1x"] * pt["load"],
                   "best": pt["best"], "best_attainment": best, "conductor": runs["conductor"]["slo_attainment"],
                   "measured_unreachable": runs["conductor"]["unreachable"],
                   **{k: {x: v for x, v in b.items() if x not in ("x", "least_ttft_s")}
                      for k, b in (("mean", mean), ("noisy", noisy))}}
            row["ceiling_mean"] = mean["attainment_bound"] / best
            row["ceiling_noisy"] = noisy["attainment_bound"] / best
            if a.check:
                row["check"] = check(a, spec, w, pt, measured["slo_tbt_ms"] / 1000,
                                     {"mean": mean, "noisy": noisy})
                print("    check: " + "; ".join(
                    f"{c['policy']} TTFT attainment {c['ttft_attainment']:.3f}, min TTFT / least "
                    f"{c['min_ttft_over_least']:.3f}, below least {c['below_least']['mean']} "
                    f"({c['below_least']['noisy']})" for c in row["check"]), file=sys.stderr, flush=True)
            out.append(row)
            print(f"  {name} TTFT {pt['ttft_s']:g}s {row['load_label']}: bound {mean['attainment_bound']:.3f} "
                  f"({noisy['attainment_bound']:.3f} at -{a.noise_z:g} sigma), unreachable {mean['unreachable']} "
                  f"({noisy['unreachable']}), best other {pt['best']} {best:.3f}: ceiling {row['ceiling_mean']:.2f}x "
                  f"({row['ceiling_noisy']:.2f}x); LP {mean['lp']['variables']} variables, "
                  f"{mean['lp']['constraints']} constraints, solved in {mean['lp']['solve_s']:.2f} s "
                  f"({noisy['lp']['solve_s']:.2f} s)", file=sys.stderr, flush=True)
    return out


def render(rows: list[dict[str, Any]], a: argparse.Namespace, measured: dict[str, Any], command: str) -> str:
    sigma = engine_sigma(load_profile(measured["profile"]), C.cluster().noise)
    f = math.exp(-a.noise_z * sigma)
    table = C.md_table(
        ["workload", "TTFT SLO", "load", "offered req/s", "unreachable (any policy)", "reachable share",
         "attainment bound", "first holder / paid once", f"bound, steps at -{a.noise_z:g} sigma",
         "best other (measured)", "conductor (measured)",
         "ceiling: bound / best other", f"ceiling at -{a.noise_z:g} sigma", "conductor / bound",
         "conductor's share of the headroom", "1.2x"],
        [[r["workload"], f"{r['ttft_s']:g} s", r["load_label"], f"{r['offered_rps']:.1f}",
          f"{r['mean']['unreachable']} ({r['noisy']['unreachable']})", C.pct(r["mean"]["reachable_bound"]),
          C.pct(r["mean"]["attainment_bound"]), accountings(r["mean"]), C.pct(r["noisy"]["attainment_bound"]),
          f"{C.pct(r['best_attainment'])} ({r['best']})", C.pct(r["conductor"]), f"**{r['ceiling_mean']:.2f}x**",
          f"{r['ceiling_noisy']:.2f}x", f"{r['conductor'] / r['mean']['attainment_bound']:.2f}", headroom(r),
          verdict(r["ceiling_mean"], r["ceiling_noisy"])] for r in rows])
    sizes = C.md_table(
        ["workload", "TTFT SLO", "load", "slot (s)", "slots", "LP variables", "LP constraints", "solve (s)",
         f"solve at -{a.noise_z:g} sigma (s)", "least prefill work of the reachable (instance-s)",
         "prefill capacity, first arrival to last deadline (instance-s)"],
        [[r["workload"], f"{r['ttft_s']:g} s", r["load_label"], f"{r['ttft_s'] / a.slots_per_slo:g}",
          r["mean"]["lp"]["slots"], r["mean"]["lp"]["variables"], r["mean"]["lp"]["constraints"],
          f"{r['mean']['lp']['solve_s']:.2f}", f"{r['noisy']['lp']['solve_s']:.2f}", f"{r['mean']['work_s']:.0f}",
          f"{r['mean']['capacity_s']:.0f}"] for r in rows])
    checks = [[r["workload"], f"{r['ttft_s']:g} s", r["load_label"], c["policy"], c["served"],
               C.pct(c["ttft_attainment"]), C.pct(c["attainment"]), C.pct(r["mean"]["attainment_bound"]),
               f"{c['min_ttft_over_least']:.3f}" if c["min_ttft_over_least"] is not None else "-",
               f"{c['below_least']['mean']} ({c['below_least']['noisy']})"]
              for r in rows for c in r.get("check", [])]
    check_table = C.md_table(
        ["workload", "TTFT SLO", "load", "policy (oracle predictors)", "served", "TTFT attainment",
         "attainment (TTFT and TBT)", "attainment bound", "actual / least TTFT, min", "below least TTFT"],
        checks) if checks else "(not run: `--check ''`)\n"
    return f"""
**Command** (regenerates this block and results.json):

```
{command}
```

**What it bounds.** For every point of [goodput-curves.md](goodput-curves.md) (the same evaluation
slices, loads and SLOs; {measured['prefill']}P+{measured['decode']}D `{measured['profile']}`), the SLO
attainment (TTFT <= SLO over requests sent) that **no** policy could exceed, whatever its placement,
admission or order, computed by `loadgen/simulate/bound.py` from the sim engine's own step-time
model (an offline analysis; no predictor reads it). A relaxation, so every real schedule is feasible in
it:
- *Least TTFT per request*: its prefill with the prefix it shares with earlier arrivals cached
  (unbounded reuse) from the earliest time their first holder could have computed it; the blocks no
  earlier arrival holds computed after it arrives, in prefix order (by it or by a later arrival
  sharing them), however the engine chunks them, each step at least that chunk alone plus its
  attention in the densest step; then the least hand-over (the KV pull of what its decode instance
  could lack, on an idle link, and one decode step). Over the SLO: *unreachable* for every policy.
- *Capacity*: a slot LP (HiGHS; slot = SLO / {a.slots_per_slo}) over the {measured['prefill']} prefill
  instances: each request's least prefill work (every token at the engine's best per-token
  efficiency: a full {C.cluster().engine['max_num_batched_tokens']}-token step, attention at its
  most diluted), done only in slots overlapping [arrival, deadline - least hand-over], at most one
  slot's worth per slot; served fractions maximised. Tokens shared with an earlier arrival are costed
  two ways, each a relaxation: *first holder*, free to later requests, each block paid by its first
  holder in proportion to that holder's own served fraction (so a refused holder's prefix costs no
  one); *paid once*, a block computed at least once if any request holding it is served, within
  [its first holder's arrival, the last such request's window end], as a job of its own that every
  request needing it waits on. Bound = the lower LP optimum / requests sent.
- Left out (each only raises the bound): decode capacity and TBT, KV capacity and eviction,
  queueing behind a running step, network contention, the engine's first-come-first-served order.
- Noise: the engine multiplies each step by exp(N(0, sigma)), sigma {sigma:.4f}, which has no hard
  floor. "Attainment bound" uses the mean step times (exact for `noise = 0`); the next column scales
  *every* step by exp(-{a.noise_z:g} sigma) = {f:.3f}, sound unless some step ran faster than that.

"Ceiling" = bound / the best other policy's measured attainment in goodput-curves/results.json: the
largest goodput ratio over it that any policy (conductor included) could have at that point.
"1.2x": **impossible** when even the noisy ceiling is below 1.2; "impossible at mean step times" when
only the mean-time ceiling is; "not excluded" otherwise (the bound is loose: not a claim that 1.2x is
reachable). "unreachable": mean times (at -{a.noise_z:g} sigma); "conductor / bound": how far the
measured conductor stands below the mean-time bound; "share of the headroom": (conductor - best
other) / (bound - best other).

{table}
**LP sizes and solve times** (one process, on 2 cores shared with other work):

{sizes}
**Soundness check against real runs.** The `--check` policies simulated at every point (same slice,
cluster and seed; oracle predictors, admitting against the SLO): their attainment must stay below the
bound, and no served request's TTFT below its least TTFT ("below least": at mean step times; in
brackets at -{a.noise_z:g} sigma, the only count the argument requires to be 0).

{check_table}"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(G.LOADS), help="comma-separated subset of goodput-curves' workloads")
    p.add_argument("--noise-z", type=float, default=4.0,
                   help="the noisy bound: every engine step this many sigma faster than its mean (default 4)")
    p.add_argument("--slots-per-slo", type=int, default=20, help="LP time slots per TTFT SLO (default 20)")
    p.add_argument("--check", default="conductor,round_robin",
                   help="policies simulated at every point against the bound (oracle predictors; '' skips)")
    p.add_argument("--workers", type=int, default=2, help="parallel simulations for --check (default 2)")
    p.add_argument("--from-results", action="store_true", help="re-render the page from its results.json")
    a = p.parse_args()
    if a.noise_z < 0 or a.slots_per_slo < 1:
        p.error("--noise-z must be >= 0 and --slots-per-slo >= 1")
    measured = json.loads((C.DOCS / G.PAGE / "results.json").read_text())
    if a.from_results:
        saved = json.loads((C.DOCS / PAGE / "results.json").read_text())
        rows, command = saved["points"], saved["command"]
        a.noise_z, a.slots_per_slo = saved["noise_z"], saved["slots_per_slo"]
    else:
        rows, command = bound_points(a, measured), C.command_line()
    if not rows:
        p.error(f"no point of goodput-curves/results.json for workloads {a.workloads}")
    C.save_json(C.DOCS / PAGE / "results.json", {"command": command, "profile": measured["profile"],
                                                 "prefill": measured["prefill"], "noise_z": a.noise_z,
                                                 "slots_per_slo": a.slots_per_slo, "points": rows})
    C.write_doc(C.DOCS / f"{PAGE}.md", "Goodput ceiling: what no policy could exceed at each point of the curves",
                render(rows, a, measured, command), DISCUSSION, command)
    print(f"wrote {C.DOCS / PAGE}.md")


if __name__ == "__main__":
    main()
