"""The shared KV store on the live embedded cluster: ``conductor serve`` with its sim engines and
``conductor sim-store`` against the same cluster with ``[embedded] store = false``, and conductor
against round robin with the store on (issue 10's documented run). Real time, loopback only.

    .venv/bin/python bench/experiments/store_live.py [--limit 400] [--speedup 2] [--repeat 2]

Each pair is two gateways started side by side on free loopback ports and one ``conductor loadgen``
run with ``--target A --target B --repeat N``: every repetition sends the same Mooncake
conversation slice to both, in the order A B, then B A, ... (fresh prompt salts per step and
target, so caches start cold). Reported per target and repetition: the prefix-hit ratio the
engines report (the prefill leg's cached tokens, store loads included, over prompt tokens), TTFT
p50/p90 and goodput; after the pair, the prefill engines' own counters (``vllm:prefix_cache_*``,
``sim:store_*``) and the gateway's store tier (``/admin/store``). Writes docs/experiments/store-live.md,
docs/experiments/store-live/results.json and the loadgen outputs to out/experiments/store-live/.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as C
import requests

from tests.servers import stop  # noqa: E402

TRACE = "data/traces/mooncake_conversation_trace.jsonl"
# (pair name, [(target label, policy, store)]): the first target is loadgen's baseline (A)
PAIRS = {
    "store": [("conductor, store on", "conductor", True), ("conductor, store off", "conductor", False)],
    "policy": [("conductor, store on", "conductor", True), ("round_robin, store on", "round_robin", True)],
}
DISCUSSION = """## Discussion

(hand-written; kept when the command regenerates the block above)
"""


def engine_counters(url: str) -> dict[str, Any]:
    """The prefill engines' own prefix-cache and store counters, summed, and the gateway's store tier."""
    cluster = requests.get(url + "/admin/cluster", timeout=5).json()
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "sim:store_hits_total",
             "sim:store_loads_total", "sim:store_load_seconds_total")
    tot = dict.fromkeys(names, 0.0)
    for inst in cluster["instances"]:
        if inst["role"] == "decode":
            continue
        text = requests.get(inst["url"] + "/metrics", timeout=5).text
        for n in names:
            for m in re.finditer(rf"^{re.escape(n)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M):
                tot[n] += float(m.group(1))
    store = requests.get(url + "/admin/store", timeout=5)
    return {"prefill_engines": tot, "admin_store": store.json() if store.status_code == 200 else store.status_code}


def run_pair(pair: str, a: argparse.Namespace, cfg_dir: Path) -> dict[str, Any]:
    procs, urls = [], []
    try:
        for k, (_, policy, store) in enumerate(PAIRS[pair]):
            proc, url = C.start_gateway(cfg_dir, f"{pair}-{k}", policy=policy, store=store, admission=False,
                                        prefill=a.prefill, decode=a.decode, ttft_ms=a.slo_ttft_ms, tbt_ms=a.slo_tbt_ms)
            procs.append(proc)
            urls.append(url)
        out = C.OUT / "store-live" / pair
        cmd = [sys.executable, "-m", "gateway.cli", "loadgen", "--target", urls[0], "--target", urls[1],
               "--trace", TRACE, "--limit", str(a.limit), "--speedup", f"{a.speedup:g}", "--repeat", str(a.repeat),
               "--slo-ttft-ms", f"{a.slo_ttft_ms:g}", "--slo-tbt-ms", f"{a.slo_tbt_ms:g}", "--seed", "0",
               "--out", str(out), "--quiet"]
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=C.ROOT, check=True)
        wall = time.monotonic() - t0
        counters = [engine_counters(u) for u in urls]
    finally:
        stop(*procs)
    summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": wall, "summary": summary, "counters": counters}


def step_row(step: dict[str, Any]) -> dict[str, Any]:
    return {"step": step["step"], "hit_ratio": step["cached_tokens"]["hit_ratio"], "ttft_p50_s": step["ttft_s"]["p50"],
            "ttft_p90_s": step["ttft_s"]["p90"], "goodput_rps": step["goodput_rps"],
            "attainment": step["slo_attainment"], "completed": step["completed"], "requests": step["requests"],
            "errors": step["errors"] + step["timeouts"], "client_bottleneck": step["client"]["bottleneck"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=400, help="first N requests of the conversation trace")
    p.add_argument("--speedup", type=float, default=2.0, help="trace speed-up")
    p.add_argument("--repeat", type=int, default=2, help="repetitions per pair, the target order alternating")
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--pairs", default="store,policy")
    a = p.parse_args()
    pairs = [x.strip() for x in a.pairs.split(",") if x.strip()]
    for x in pairs:
        if x not in PAIRS:
            p.error(f"--pairs: unknown pair {x!r} (known: {', '.join(PAIRS)})")
    cfg_dir = C.OUT / "store-live" / "gateways"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    results, sections = {}, []
    for pair in pairs:
        print(f"pair {pair}: {' vs '.join(t[0] for t in PAIRS[pair])}", file=sys.stderr, flush=True)
        r = run_pair(pair, a, cfg_dir)
        s = r["summary"]
        rows, per_target = [], []
        for k, (label, _, _) in enumerate(PAIRS[pair]):
            t = s["targets"][k]
            steps = [step_row(x) for x in t["steps"]]
            eng = r["counters"][k]["prefill_engines"]
            q = eng["vllm:prefix_cache_queries_total"]
            per_target.append({"label": label, "steps": steps, "spread": t["spread"], "counters": r["counters"][k]})
            for st in steps:
                first = (st["step"] % 2 == 0) == (k == 0)
                rows.append([label, f"{st['step'] + 1} ({'first' if first else 'second'})", C.pct(st["hit_ratio"]),
                             C.sec(st["ttft_p50_s"]), C.sec(st["ttft_p90_s"]), C.pct(st["attainment"]),
                             C.sec(st["goodput_rps"]), f"{st['completed']}/{st['requests']}", st["errors"]])
            hits = [x["hit_ratio"] for x in steps]
            goodputs = [x["goodput_rps"] for x in steps]
            rows.append([f"**{label}**", "mean (spread)",
                         f"{C.pct(sum(hits) / len(hits))} ({C.pct(min(hits))}-{C.pct(max(hits))})",
                         C.sec(C.mean(x["ttft_p50_s"] for x in steps)), C.sec(C.mean(x["ttft_p90_s"] for x in steps)),
                         C.pct(C.mean(x["attainment"] for x in steps)),
                         f"{C.sec(C.mean(goodputs))} ({C.sec(min(goodputs))}-{C.sec(max(goodputs))})",
                         "", ""])
            per_target[-1]["engine_hit_ratio"] = eng["vllm:prefix_cache_hits_total"] / q if q else None
        results[pair] = {"wall_s": r["wall_s"], "targets": per_target,
                         "client_bottleneck": s.get("client_bottleneck")}
        eng_rows = []
        for t in per_target:
            e, st = t["counters"]["prefill_engines"], t["counters"]["admin_store"]
            q = e["vllm:prefix_cache_queries_total"]
            eng_rows.append([t["label"], f"{int(q):,}", C.pct(t["engine_hit_ratio"]),
                             C.pct(e["sim:store_hits_total"] / q if q else None), f"{int(e['sim:store_loads_total'])}",
                             C.sec(e["sim:store_load_seconds_total"]), store_text(st)])
        sections.append(f"""### {' vs '.join(t[0] for t in PAIRS[pair])}

`conductor loadgen` wall time {r['wall_s']:.0f} s; client bottleneck flagged: {s.get('client_bottleneck')}.

""" + C.md_table(["target", "repetition (order)", "prefix hit (engine-reported)", "TTFT p50 (s)", "TTFT p90 (s)",
                  "attainment", "goodput (req/s)", "completed", "errors"], rows) + """
The prefill engines' own counters over both repetitions (`/metrics` of each prefill engine, summed;
prompt tokens include the first token the prefill leg generates) and the gateway's store tier:

""" + C.md_table(["target", "prompt tokens queried", "prefix hits", "of which loaded from the store",
                  "store loads", "store load time (modelled s)", "gateway store tier (/admin/store)"], eng_rows))
    C.save_json(C.DOCS / "store-live" / "results.json", {"args": vars(a), "results": results})
    minutes = sum(r["wall_s"] for r in results.values()) / 60
    gen = f"""
**Command** (regenerates this block and results.json; about {minutes:.0f} minutes of load):

```
{C.command_line()}
```

**Setup.** `conductor serve` with its embedded simulated cluster, {a.prefill} prefill + {a.decode} decode
`llama3-8b-h200` sim engines (vLLM two-step PD, time scale 1: real seconds), with the embedded
`conductor sim-store` (one 64 GB DRAM node per prefill engine; docs/store.md) or without it
(`[embedded] store = false`); SLO admission off (every request served: placement alone differs).
Load: `conductor loadgen --trace {TRACE} --limit {a.limit} --speedup {a.speedup:g} --repeat {a.repeat}`
against both gateways of a pair, the order alternating per repetition. A request meets the SLO with
TTFT <= {a.slo_ttft_ms / 1e3:g} s and TBT (mean of its slowest 10% of gaps) <= {a.slo_tbt_ms:g} ms; goodput =
requests meeting it / step duration. **The machine has 2 cores, possibly shared with other jobs
(the Discussion below says what ran beside it): absolute times are noisy; compare within a
pair and look at the spread between repetitions.**

""" + "\n".join(sections)
    C.write_doc(C.DOCS / "store-live.md", "The shared KV store on the live embedded cluster", gen, DISCUSSION)
    print(gen)


def store_text(st: Any) -> str:
    if not isinstance(st, dict):
        return f"HTTP {st}"
    keys = ("mode", "stale", "lookups", "resident_blocks", "lookup_p99_ms")
    return ", ".join(f"{k} {st[k]}" for k in keys if k in st) or json.dumps(st)[:80]


if __name__ == "__main__":
    main()
