"""The SLO attainment no policy could exceed on the workload of one ``conductor simulate`` command
line: the relaxation of loadgen/simulate/bound.py for its cluster, load and SLOs, with the prefill
pool alone (goodput-bound.md's) and with the decode pool added (decode bandwidth too).

    .venv/bin/python bench/experiments/attainment_bound.py [--noise-z 4] [--measured OUT/summary.json] \\
        -- SIMULATE FLAGS (as given to `conductor simulate`)

Prints one line per bound; ``--measured`` adds the run's attainment and the ceiling over it (the
largest goodput ratio any policy could have over that run).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from types import SimpleNamespace

import _common  # noqa: F401  (puts the repository on the path)

from engines_adapters.sim.profiles import load_profile  # noqa: E402
from loadgen.simulate.bound import attainment_bound, engine_sigma  # noqa: E402
from loadgen.simulate.cli import build_parser  # noqa: E402
from loadgen.simulate.reuse import prompt_blocks  # noqa: E402
from loadgen.sweep import workload_at  # noqa: E402
from loadgen.workload_args import workload_from_args  # noqa: E402
from predictors.cli_args import CLIError  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--noise-z", type=float, default=4.0, help="also bound with every step this many sigma faster")
    p.add_argument("--measured", help="a `conductor simulate` summary.json to set the bound against")
    p.add_argument("simulate", nargs=argparse.REMAINDER, help="-- then the `conductor simulate` flags")
    a = p.parse_args(argv)
    sim = build_parser().parse_args([x for x in a.simulate if x != "--"] + ["--out", "/nonexistent"])
    try:
        w = workload_from_args(sim, lambda m: print(m, file=sys.stderr))
    except CLIError as e:
        p.error(str(e))
    if w.slo.ttft_s is None:
        p.error("the simulate flags need --slo-ttft-ms")
    if sim.both:
        p.error("the bound models disaggregated clusters only (--prefill N --decode M)")
    load = w.loads[0]
    wl = workload_at(SimpleNamespace(base=w.base, load_kind=w.load_kind, regenerate=w.regenerate,  # a LoadSpec
                                     arrival=sim.arrival, cv=sim.burstiness, seed=sim.seed), load)
    profile = load_profile(sim.profile)
    blocks = list(prompt_blocks(wl, sim.block_size, "chat", f"sim-{sim.seed}"))
    arrivals = [r.arrival_s for r in wl.requests]
    outputs = [r.output_length for r in wl.requests]
    sigma = engine_sigma(profile, sim.noise)
    measured = None
    if a.measured:
        with open(a.measured) as f:
            s = json.load(f)
        measured = (s.get("runs") or [s])[0]["slo_attainment"]
    print(f"{len(arrivals)} requests at load {load:g}; {sim.prefill}P+{sim.decode}D {sim.profile}; "
          f"TTFT <= {w.slo.ttft_s:g} s, TBT <= {w.slo.tbt_s} s")
    for pools, decode in (("prefill", 0), ("prefill + decode", sim.decode)):
        if decode and w.slo.tbt_s is None:
            continue
        for z in (0.0, a.noise_z):
            b = attainment_bound(arrivals, blocks, profile, prefill=sim.prefill, ttft_s=w.slo.ttft_s,
                                 block_size=sim.block_size, budget=sim.max_num_batched_tokens, noise_sigma=sigma,
                                 noise_z=z, decode=decode, outputs=outputs, tbt_s=w.slo.tbt_s)
            acc = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in b["accounting"].items())
            line = (f"{pools:>16}, steps at -{z:g} sigma: bound {b['attainment_bound']:.4f} "
                    f"({acc}; unreachable {b['unreachable']}; LP {b['lp']['variables']} variables, "
                    f"{b['lp']['solve_s']:.1f} s)")
            if measured is not None:
                ratio = b["attainment_bound"] / measured if measured else math.inf
                line += f"; measured {measured:.4f}: ceiling {ratio:.3f}x"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
