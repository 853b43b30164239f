"""How often conductor's near-tie affinity changes the prefill choice, per margin.

    .venv/bin/python bench/experiments/affinity_fires.py --workload conversation --slice train \\
        --margins 0.1,0.5,1,2 --settings 5:5,30:12

Uses the learned predictors a goodput_curves.py run calibrated (out/experiments/goodput-curves/
<workload>/models) on the gap cluster, 8P+8D, and counts, over one simulated run per margin and
setting (TTFT SLO s : load), the decisions where the rule picked a holder over the cheapest
candidate. Prints one line per run with attainment and prefix hit. ``--slice train`` (the
default) is the slice tuning may look at; ``eval`` the held-out one.
"""
from __future__ import annotations

import argparse
import dataclasses

import _common as C
import baselines as B
import overload_admission as O

import scheduler.policies.conductor as conductor_module  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="conversation")
    p.add_argument("--slice", choices=["train", "eval"], default="train")
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--eval", type=int, default=1500)
    p.add_argument("--margins", default="0.1,0.5,1,2", help="affinity_margin_s values (s)")
    p.add_argument("--settings", default="5:5,30:12", help="TTFT_SLO_S:LOAD pairs")
    a = p.parse_args()
    counts = {"calls": 0, "fired": 0}
    rule = conductor_module.near_tie_holder

    def counting(*args, **kw):  # type: ignore[no-untyped-def]
        counts["calls"] += 1
        out = rule(*args, **kw)
        counts["fired"] += out is not None
        return out

    conductor_module.near_tie_holder = counting  # type: ignore[assignment]
    spec = dataclasses.replace(C.cluster(8, 8), profile=B.PROFILE)
    train_w, eval_w = B.slices(a.workload, a.train, a.eval)
    w = train_w if a.slice == "train" else eval_w
    models = str(C.OUT / "goodput-curves" / a.workload / "models")
    for setting in a.settings.split(","):
        ttft, load = map(float, setting.split(":"))
        for m in map(float, a.margins.split(",")):
            counts.update(calls=0, fired=0)
            s = O.sweep(w, spec, ["conductor"], load, SLO(ttft, 0.2), models, {"affinity_margin_s": m}, 1,
                        None)["conductor"][0]
            print(f"{a.workload} {a.slice} TTFT {ttft:g} s load {load:g} margin {m:g} s: the rule changed "
                  f"{counts['fired']} of {len(w.requests)} choices ({counts['fired'] / len(w.requests):.1%}); "
                  f"attainment {s['slo_attainment']:.1%}, prefix hit {s['hit_ratio']:.1%}", flush=True)


if __name__ == "__main__":
    main()
