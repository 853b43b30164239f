"""Experiment 7: the paper's "global cache vs per-node cache" hit rates, over the cache capacity
each node lends (Mooncake reports up to 2.36x for a global cache).

    .venv/bin/python bench/experiments/store_global.py [--limit 2000] [--gb 0,32,128,1024] [--workers 2]

Every point is one ``conductor simulate`` pair (conductor and round robin, the same requests) on
8 prefill + 8 decode ``llama3-70b-a800x8`` instances. Each prefill node keeps its GPU prefix
cache (HBM, per node in every run) and lends the same DRAM, either
* **per-node**: as a private host-memory KV tier of its own engine (``--host-tier-tokens``), or
* **global**: to the shared Mooncake-style store (``--store --store-nodes 8 --store-gb G``): one
  pool every prefill engine writes through to and loads from.
Same memory, same requests; only whether the DRAM is pooled differs. Beside them, two replays of
the prompts through plain LRU caches of the same sizes, no serving at all: one global LRU of all
the nodes' memory (``simulate --reuse-bound``'s bound, at this capacity) and per-node LRUs fed in
round-robin order (the paper's local-cache replay). Writes docs/experiments/store-global.md,
docs/experiments/store-global/ (hit_ratio.png, results.json) and the full outputs to
out/experiments/store-global/.
"""
from __future__ import annotations

import argparse
from collections import OrderedDict

import _common as C
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from engines_adapters.sim.profiles import load_profile  # noqa: E402
from engines_adapters.store.model import StoreSpec  # noqa: E402
from engines_adapters.tokenizer import ByteTokenizer  # noqa: E402
from loadgen.prompts import ChatFraming, PromptSynth  # noqa: E402
from loadgen.simulate.reuse import reuse_bound  # noqa: E402
from loadgen.simulate.run import prompt_tokens  # noqa: E402
from loadgen.workload import Workload  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402
from scheduler.hashing import block_hashes  # noqa: E402

PAPER_MAX_GAIN = 2.36
POLICIES = ["conductor", "round_robin"]
GB = 1e9  # as ``conductor simulate --store-gb``

DISCUSSION = """## Discussion

(hand-written; kept when the command regenerates the block above)
"""


def per_node_lru(workload: Workload, block_size: int, nodes: int, capacity_tokens: int, seed: int) -> float | None:
    """Hit ratio of ``nodes`` private LRU caches of ``capacity_tokens`` each, prompts dealt out in
    round-robin order: the contiguous cached prefix of complete blocks, never the block holding the
    prompt's last token (as loadgen/simulate/reuse.py counts the global bound)."""
    synth, framing, tok = PromptSynth(workload.block_tokens, f"sim-{seed}"), ChatFraming.of(), ByteTokenizer()
    cap = max(1, capacity_tokens // block_size)
    lrus: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(nodes)]
    total = hit = 0
    for i, req in enumerate(workload.requests):
        tokens = prompt_tokens(req, synth, framing, "chat", tok)
        hashes = block_hashes(tokens, block_size)
        usable = min(len(hashes), (len(tokens) - 1) // block_size)
        lru = lrus[i % nodes]
        k = 0
        while k < usable and hashes[k] in lru:
            k += 1
        total += len(tokens)
        hit += k * block_size
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > cap:
            lru.popitem(last=False)
    return hit / total if total else None


def policy_row(outcome, policy: str) -> dict:
    t = next(x for x in outcome.summary.get("targets", [outcome.summary]) if x["target"] == policy)
    return {"hit_ratio": t["cached_tokens"]["hit_ratio"], "ttft_p50_s": t["ttft_s"]["p50"],
            "ttft_p90_s": t["ttft_s"]["p90"], "attainment": t["slo_attainment"], "goodput_rps": t["goodput_rps"],
            "completed": t["completed"], "requests": t["requests"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=2000, help="first N requests of the conversation trace")
    p.add_argument("--gb", default="0,32,128,1024", help="DRAM each prefill node lends, GB (0: HBM only)")
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--slo-ttft-s", type=float, default=30.0)
    p.add_argument("--slo-tbt-ms", type=float, default=100.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--hbm-tokens", default="full,262144",
                   help="prefix cache each prefill engine keeps in HBM, tokens, one series each ('full': the "
                        "profile's whole KV pool; a smaller pool stands for cache pressure: the HBM holds "
                        "less of the reuse window)")
    a = p.parse_args()
    points = [float(x) for x in a.gb.split(",") if x.strip()]
    if any(g < 0 for g in points):
        p.error("--gb: sizes must be >= 0")
    slo = SLO(a.slo_ttft_s, a.slo_tbt_ms / 1e3)
    prof = load_profile(C.PROFILE)
    bpt = prof.kv_bytes_per_token
    hbms = [prof.kv_capacity_tokens if x.strip() == "full" else int(x) for x in a.hbm_tokens.split(",") if x.strip()]
    base = C.load_trace("conversation", a.limit or None)
    out, figs = C.OUT / "store-global", C.DOCS / "store-global"
    inf = reuse_bound(base, 16, 1, "chat", salt="sim-0")["infinite_hit_ratio"]
    series = []
    for hbm in hbms:
        rows = []
        tag = "full" if hbm == prof.kv_capacity_tokens else f"{hbm}"
        for gb in points:
            dram_tokens = int(gb * GB // bpt)
            node_tokens = hbm + dram_tokens
            row = {"dram_gb": gb, "dram_tokens_per_node": dram_tokens, "cache_tokens_per_node": node_tokens,
                   "global_lru": reuse_bound(base, 16, node_tokens * a.prefill, "chat", salt="sim-0")["lru_hit_ratio"],
                   "per_node_lru_rr": per_node_lru(base, 16, a.prefill, node_tokens, 0)}
            spec = C.cluster(a.prefill, a.decode)
            spec.prefill_engine = {"kv_capacity_tokens": hbm, "host_tier_tokens": dram_tokens}
            o = C.sweep(base, spec, POLICIES, loads=[1.0], metric_slo=slo, workers=a.workers,
                        out=out / f"hbm-{tag}" / f"per-node-{gb:g}gb")
            row["per_node"] = {pol: policy_row(o, pol) for pol in POLICIES}
            if gb > 0:
                spec = C.cluster(a.prefill, a.decode)
                spec.prefill_engine = {"kv_capacity_tokens": hbm}
                spec.store = StoreSpec(nodes=a.prefill, dram_bytes=int(gb * GB))
                o = C.sweep(base, spec, POLICIES, loads=[1.0], metric_slo=slo, workers=a.workers,
                            out=out / f"hbm-{tag}" / f"global-{gb:g}gb")
                row["global"] = {pol: policy_row(o, pol) for pol in POLICIES}
            else:  # no DRAM to pool: the HBM caches are all there is, the same run
                row["global"] = row["per_node"]
            rows.append(row)
        series.append({"hbm_tokens_per_node": hbm, "full_hbm": hbm == prof.kv_capacity_tokens, "rows": rows})
    C.save_json(figs / "results.json", {"profile": C.PROFILE, "requests": len(base.requests), "span_s": base.span_s,
                                        "prefill": a.prefill, "decode": a.decode, "kv_bytes_per_token": bpt,
                                        "infinite_hit_ratio": inf, "series": series})
    plot(series, inf, figs / "hit_ratio.png", len(base.requests))
    tables = []
    for s in series:
        table = []
        for r in s["rows"]:
            for pol in POLICIES:
                pn, gl = r["per_node"][pol], r["global"][pol]
                ratio = gl["hit_ratio"] / pn["hit_ratio"] if pn["hit_ratio"] else None
                table.append([f"{r['dram_gb']:g} GB", pol, C.pct(pn["hit_ratio"]), C.pct(gl["hit_ratio"]),
                              "-" if ratio is None else f"{ratio:.2f}x",
                              f"{C.sec(pn['ttft_p50_s'])} / {C.sec(gl['ttft_p50_s'])}",
                              f"{C.sec(pn['ttft_p90_s'])} / {C.sec(gl['ttft_p90_s'])}",
                              f"{C.sec(pn['goodput_rps'])} / {C.sec(gl['goodput_rps'])}"])
        bounds = [[f"{r['dram_gb']:g} GB", f"{r['cache_tokens_per_node'] / 1e6:.2f}M", C.pct(r["per_node_lru_rr"]),
                   C.pct(r["global_lru"]),
                   f"{r['global_lru'] / r['per_node_lru_rr']:.2f}x" if r["per_node_lru_rr"] else "-"]
                  for r in s["rows"]]
        name = (f"the whole HBM pool, {s['hbm_tokens_per_node'] / 1e6:.2f}M tokens" if s["full_hbm"]
                else f"{s['hbm_tokens_per_node'] / 1e3:.0f}k tokens ({s['hbm_tokens_per_node'] * bpt / GB:.0f} GB)")
        tables.append(f"""### HBM prefix cache per prefill node: {name}

Served (`conductor simulate`; columns with two figures are per-node / global):

""" + C.md_table(["DRAM per node", "policy", "hit, per-node", "hit, global", "global / per-node",
                  "TTFT p50 (s)", "TTFT p90 (s)", "goodput (req/s)"], table) + """
Cache replays of the same prompts (no serving: plain LRUs of each node's HBM + DRAM, complete
16-token blocks):

""" + C.md_table(["DRAM per node", "cache per node (tokens)", "per-node LRUs, round robin", "one global LRU",
                  "global / per-node"], bounds))
    gen = f"""
**Command** (regenerates this block, the figure and results.json):

```
{C.command_line()}
```

**Setup.** The Mooncake conversation trace, first {len(base.requests)} requests ({base.span_s:.0f} s of
trace time, replayed at 1x), {a.prefill} prefill + {a.decode} decode `{C.PROFILE}` instances (LLaMA3-70B,
8 x A800 each: {prof.kv_capacity_tokens / 1e6:.2f}M tokens of HBM KV pool per node at {bpt // 1024} KiB a
token), chunked prefill, analytic predictors, no admission control (every request served; TTFT <=
{a.slo_ttft_s:g} s and TBT <= {a.slo_tbt_ms:g} ms only measured). Per point each prefill node lends the
same DRAM: to a private host KV tier of its engine (**per-node**) or to the shared store ({a.prefill} store
nodes, RDMA Transfer Engine figures, write-through; docs/store.md) (**global**); its HBM prefix cache
is per node in both. Two series: the whole HBM pool, and a smaller HBM pool on the prefill engines
(decode engines untouched) standing for cache pressure. Prefix hit = prompt tokens an engine did not
compute (device, host tier or store) / prompt tokens. The trace's own reuse (an infinite cache):
**{C.pct(inf)}**.

""" + "\n".join(tables) + """
![prefix-hit ratio vs DRAM per node](store-global/hit_ratio.png)
"""
    C.write_doc(C.DOCS / "store-global.md", "Experiment 7: global cache vs per-node caches (hit ratio vs capacity)",
                gen, DISCUSSION)
    print(gen)
    print(f"wrote {C.DOCS / 'store-global.md'}")


def plot(series: list[dict], inf: float | None, path, limit: int) -> None:
    fig, axes = plt.subplots(len(series), 2, figsize=(12, 4.6 * len(series)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    for (ax, ax2), s in zip(axes, series, strict=True):
        rows = s["rows"]
        xs = list(range(len(rows)))
        for i, pol in enumerate(POLICIES):
            ax.plot(xs, [100 * r["per_node"][pol]["hit_ratio"] for r in rows], "o-", color=f"C{i}",
                    label=f"{pol}, per-node caches")
            ax.plot(xs, [100 * r["global"][pol]["hit_ratio"] for r in rows], "s--", color=f"C{i}",
                    label=f"{pol}, per-node HBM + global store")
            ax2.plot(xs, [r["global"][pol]["hit_ratio"] / r["per_node"][pol]["hit_ratio"] for r in rows], "o-",
                     color=f"C{i}", label=pol)
        ax.plot(xs, [100 * r["global_lru"] for r in rows], "k^:", label="replay: one global LRU (reuse bound)")
        ax.plot(xs, [100 * r["per_node_lru_rr"] for r in rows], "v:", color="grey",
                label="replay: per-node LRUs, round robin")
        ax2.plot(xs, [r["global_lru"] / r["per_node_lru_rr"] for r in rows], "v:", color="grey",
                 label="replay (global / per-node RR)")
        if inf is not None:
            ax.axhline(100 * inf, color="k", lw=0.8, alpha=0.5)
            ax.text(0, 100 * inf + 0.5, f"infinite cache {100 * inf:.1f}%", fontsize=8)
        ax2.axhline(PAPER_MAX_GAIN, color="red", lw=0.8, alpha=0.6)
        ax2.text(0, PAPER_MAX_GAIN + 0.05, "paper: up to 2.36x", fontsize=8, color="red")
        ax2.axhline(1, color="k", lw=0.6)
        for a in (ax, ax2):
            a.set_xticks(xs, [f"{r['dram_gb']:g}" for r in rows])
            a.set_xlabel("DRAM lent per prefill node (GB), beside its HBM cache")
            a.grid(alpha=0.3)
        ax.set_ylabel("prefix-hit ratio (% of prompt tokens)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        ax.set_title(f"HBM prefix cache per prefill node: {s['hbm_tokens_per_node'] / 1e6:.2f}M tokens", fontsize=9)
        ax2.set_ylabel("hit ratio, global / per-node")
        ax2.set_ylim(bottom=0)
        ax2.legend(fontsize=7)
    fig.suptitle(f"Global cache vs per-node caches, conversation trace (first {limit} requests), {C.PROFILE}",
                 fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
