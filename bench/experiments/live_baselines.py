"""Conductor against the other built-in policies on the live embedded cluster (issue 15's live
confirmation): one gateway per policy, each with its own embedded cluster of simulated engines in
real time, every one admitting against the same SLO, and one ``conductor loadgen`` run sending the
same Mooncake conversation slice to each in turn. Loopback only.

    .venv/bin/python bench/experiments/live_baselines.py [--rivals dynamo_cost,sglang_cache_aware,prefix_only]
        [--slo-ttft-ms 30000,5000] [--limit 400] [--speedup 8] [--repeat 2] [--defer]

``loadgen --repeat N`` runs the targets one after another, in the listed order on even repetitions
and reversed on odd ones, so over two repetitions every target is as often early as late (a
repeated load in comparison mode was the position bias issue 15 measured). One load and one SLO per
``--slo-ttft-ms`` value. ``--defer`` adds a target ``conductor+defer``: conductor with deferred
dispatch (``--policy-param defer=on``, gateway/waiting.py). Writes docs/experiments/live-baselines.md,
its results.json, and the loadgen outputs to out/experiments/live-baselines/.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as C

from tests.servers import stop  # noqa: E402

TRACE = "data/traces/mooncake_conversation_trace.jsonl"
DISCUSSION = """## Discussion

(hand-written; kept when the command regenerates the block above)
"""


def run_slo(policies: list[str], ttft_ms: float, a: argparse.Namespace, cfg_dir: Path) -> dict[str, Any]:
    procs, urls = [], []
    try:
        for policy in policies:
            base, _, variant = policy.partition("+")  # conductor+defer: conductor, deferred dispatch on
            proc, url = C.start_gateway(cfg_dir, f"{policy}-{ttft_ms:g}", policy=base, store=False, admission=True,
                                        prefill=a.prefill, decode=a.decode, ttft_ms=ttft_ms, tbt_ms=a.slo_tbt_ms,
                                        policy_params={"defer": "on"} if variant == "defer" else None)
            procs.append(proc)
            urls.append(url)
        out = C.OUT / "live-baselines" / f"ttft-{ttft_ms:g}"
        cmd = [sys.executable, "-m", "gateway.cli", "loadgen", *[x for u in urls for x in ("--target", u)],
               "--trace", TRACE, "--limit", str(a.limit), "--speedup", f"{a.speedup:g}", "--repeat", str(a.repeat),
               "--slo-ttft-ms", f"{ttft_ms:g}", "--slo-tbt-ms", f"{a.slo_tbt_ms:g}", "--seed", "0",
               "--out", str(out), "--quiet"]
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=C.ROOT, check=True)
        wall = time.monotonic() - t0
    finally:
        stop(*procs)
    return {"wall_s": wall, "summary": json.loads((out / "summary.json").read_text())}


def target_rows(policies: list[str], summary: dict[str, Any]) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    n = len(policies)
    per, rows = [], []
    for k, policy in enumerate(policies):
        steps = summary["targets"][k]["steps"]
        att = [s["slo_attainment"] for s in steps]
        refused = sum(s["rejected"] for s in steps)
        positions = [(k if s["step"] % 2 == 0 else n - 1 - k) + 1 for s in steps]
        per.append({"policy": policy, "attainment": att, "positions": positions, "refused": refused,
                    "hit_ratio": [s["cached_tokens"]["hit_ratio"] for s in steps],
                    "ttft_p50_s": [s["ttft_s"]["p50"] for s in steps],
                    "goodput_rps": [s["goodput_rps"] for s in steps]})
    ours = {"conductor", "conductor+defer"}
    best_rival = max((p for p in per if p["policy"] not in ours), key=lambda p: C.mean(p["attainment"]) or 0.0)
    for p in per:
        m = C.mean(p["attainment"]) or 0.0
        ratio = m / (C.mean(best_rival["attainment"]) or 1.0) if p["policy"] in ours else None
        rows.append([f"**{p['policy']}**" if p["policy"] in ours else p["policy"],
                     ", ".join(f"{C.pct(x)} ({pos})" for x, pos in zip(p["attainment"], p["positions"], strict=True)),
                     C.pct(m), f"{C.pct(min(p['attainment']))}-{C.pct(max(p['attainment']))}",
                     "-" if ratio is None else f"**{ratio:.2f}x** (over {best_rival['policy']})",
                     p["refused"], C.pct(C.mean(p["hit_ratio"])), C.sec(C.mean(p["ttft_p50_s"])),
                     C.sec(C.mean(p["goodput_rps"]))])
    return per, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rivals", default="dynamo_cost,sglang_cache_aware,prefix_only",
                   help="comma-separated built-in policies to run beside conductor")
    p.add_argument("--slo-ttft-ms", default="30000,5000", help="comma-separated TTFT SLOs, one run each")
    p.add_argument("--slo-tbt-ms", type=float, default=200.0)
    p.add_argument("--limit", type=int, default=400, help="first N requests of the conversation trace")
    p.add_argument("--speedup", type=float, default=8.0, help="trace speed-up (the load)")
    p.add_argument("--repeat", type=int, default=2, help="repetitions, the target order reversed on odd ones")
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--defer", action="store_true", help="also run conductor with deferred dispatch (defer=on)")
    a = p.parse_args()
    policies = ["conductor", *(["conductor+defer"] if a.defer else []),
                *[x.strip() for x in a.rivals.split(",") if x.strip()]]
    try:
        slos = [float(x) for x in a.slo_ttft_ms.split(",") if x.strip()]
    except ValueError:
        p.error(f"--slo-ttft-ms: expected comma-separated milliseconds, got {a.slo_ttft_ms!r}")
    if len(set(policies)) != len(policies) or not slos:
        p.error("--rivals: conductor and each rival once; --slo-ttft-ms: at least one value")
    cfg_dir = C.OUT / "live-baselines" / "gateways"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    results, sections = {}, []
    for ttft_ms in slos:
        print(f"TTFT SLO {ttft_ms:g} ms: {', '.join(policies)}", file=sys.stderr, flush=True)
        r = run_slo(policies, ttft_ms, a, cfg_dir)
        per, rows = target_rows(policies, r["summary"])
        results[f"{ttft_ms:g}"] = {"wall_s": r["wall_s"], "targets": per,
                                   "client_bottleneck": r["summary"].get("client_bottleneck")}
        sections.append(f"""### TTFT <= {ttft_ms / 1e3:g} s

`conductor loadgen` wall time {r['wall_s']:.0f} s; client bottleneck flagged: {r['summary'].get('client_bottleneck')}.

""" + C.md_table(["policy", "attainment per repetition (position in the order)", "mean", "spread",
                  "conductor / best other", "refused", "prefix hit (engine-reported)", "TTFT p50 (s)",
                  "goodput (req/s)"], rows))
    C.save_json(C.DOCS / "live-baselines" / "results.json", {"args": vars(a), "results": results})
    minutes = sum(r["wall_s"] for r in results.values()) / 60
    gen = f"""
**Command** (regenerates this block and results.json; about {minutes:.0f} minutes of load):

```
{C.command_line()}
```

**Setup.** One `conductor serve` per policy, each with its own embedded cluster of {a.prefill} prefill +
{a.decode} decode simulated `llama3-8b-h200` engines (vLLM two-step PD, real time, no store), every
gateway admitting against the SLO with the analytic predictors (placement alone differs). Load:
`conductor loadgen --trace {TRACE} --limit {a.limit} --speedup {a.speedup:g} --repeat {a.repeat}` with every
gateway as a target: the targets run one after another, in the order listed on even repetitions and
reversed on odd ones (the number in brackets is the position). A request meets the SLO with its TTFT
within the SLO and TBT (mean of its slowest 10% of gaps) <= {a.slo_tbt_ms:g} ms; the goodput ratio at equal
offered load is the attainment ratio. **2 shared cores: compare within a table and read the spread.**

""" + "\n".join(sections)
    C.write_doc(C.DOCS / "live-baselines.md", "Conductor against every policy, live", gen, DISCUSSION)
    print(gen)


if __name__ == "__main__":
    main()
