"""Writing a simulated sweep out: the files ``conductor loadgen`` writes (summary.json,
requests.jsonl, goodput.png, latency.png) plus capacity.png (effective capacity against the TBT
threshold, the paper's figure) and, with several policies, compare.md/compare.png."""
from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from predictors.telemetry import SLO, write_jsonl  # noqa: E402

from ..metrics import effective_capacity, summarize  # noqa: E402
from ..plots import plot_goodput, plot_latency  # noqa: E402
from ..report import _ms, _num, _pct, write_summary_and_records  # noqa: E402
from ..sweep import load_label  # noqa: E402
from .sweep import SimOutcome  # noqa: E402

#: The paper's TBT thresholds (ms) for effective request capacity, and a finer grid for the plot.
TBT_THRESHOLDS_MS = (100, 200, 300)
_PLOT_TBT_MS = tuple(range(25, 425, 25))


def capacity_by_tbt(outcome: SimOutcome, thresholds_ms=TBT_THRESHOLDS_MS) -> dict[str, list[dict[str, Any]]]:
    """Per policy and TBT threshold: SLO attainment per load (TTFT SLO kept) and the effective
    capacity over the sweep; with a single load, the attainment itself is the capacity figure."""
    cfg = outcome.config
    out: dict[str, list[dict[str, Any]]] = {}
    for policy in cfg.policies:
        steps = sorted((s for s in outcome.steps if s.policy == policy), key=lambda s: s.load)
        rows = []
        for ms in thresholds_ms:
            slo = SLO(cfg.slo.ttft_s, ms / 1000)
            att = [summarize(s.records, slo)["slo_attainment"] for s in steps]
            cap = effective_capacity([s.load for s in steps], att, cfg.attainment_target)
            rows.append({"tbt_ms": ms, "attainment": att, "effective_capacity": cap})
        out[policy] = rows
    return out


def plot_capacity(outcome: SimOutcome, path: str) -> None:
    cfg = outcome.config
    by = capacity_by_tbt(outcome, _PLOT_TBT_MS)
    single = len(cfg.loads) == 1
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (policy, rows) in enumerate(by.items()):
        xs = [r["tbt_ms"] for r in rows]
        if single:
            ys = [100 * (r["attainment"][0] or 0.0) for r in rows]
        else:
            ys = [r["effective_capacity"]["value"] or 0.0 for r in rows]
        ax.plot(xs, ys, "o-", color=f"C{i}", lw=2, label=policy)
    ttft = "none" if cfg.slo.ttft_s is None else f"{cfg.slo.ttft_s:g} s"
    if single:
        at = load_label(cfg.load_kind, cfg.loads[0])
        ax.set_ylabel(f"effective requests (% meeting TTFT ≤ {ttft} and TBT) at {at}")
    else:
        ax.set_ylabel(f"effective capacity ({'speed-up' if cfg.load_kind == 'speedup' else 'req/s'}, "
                      f"attainment ≥ {cfg.attainment_target:.0%})")
    ax.set_xlabel("TBT threshold (ms; TBT = mean of a request's slowest 10% of token gaps)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    c = cfg.cluster
    ax.set_title(f"Effective request capacity vs TBT threshold — {c.prefill}P+{c.decode}D"
                 f"{f'+{c.both} both' if c.both else ''}, {c.profile}", fontsize=11)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def comparison_table(summary: dict[str, Any]) -> str:
    """Every policy side by side at every load (markdown)."""
    targets = summary.get("targets") or [summary]
    head = ("| policy | load | sent | ok | rejected | attainment | goodput/s | TTFT mean | TTFT p50 | TTFT p90 "
            "| TBT p90 | prefix hit |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for t in targets:
        for s in t["steps"]:
            hit = s["cached_tokens"]["hit_ratio"]
            lines.append(f"| {t['target']} | {load_label(summary['load_kind'], s['load'])} | {s['requests']} | "
                         f"{s['completed']} | {s['rejected']} | {_pct(s['slo_attainment'])} | "
                         f"{_num(s['goodput_rps'])} | "
                         f"{_ms(s['ttft_s']['mean'])} | {_ms(s['ttft_s']['p50'])} | {_ms(s['ttft_s']['p90'])} | "
                         f"{_ms(s['tbt_s']['p90'])} | {_pct(hit)} |")
    return "\n".join(lines) + "\n\n(times in ms; attainment = requests meeting the SLO / requests sent)\n"


def plot_compare(summary: dict[str, Any], path: str) -> None:
    targets = summary.get("targets") or [summary]
    loads = [s["load"] for s in targets[0]["steps"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
    width = 0.8 / len(targets)
    for i, t in enumerate(targets):
        xs = [k + i * width for k in range(len(loads))]
        a1.bar(xs, [s["goodput_rps"] or 0 for s in t["steps"]], width, label=t["target"], color=f"C{i}")
        a2.bar(xs, [(s["ttft_s"]["mean"] or 0) for s in t["steps"]], width, label=t["target"], color=f"C{i}")
    for ax, name in ((a1, "goodput (requests/s meeting the SLO)"), (a2, "mean TTFT (s)")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(loads))],
                      [load_label(summary["load_kind"], x) for x in loads])
        ax.set_ylabel(name)
        ax.grid(alpha=0.3, axis="y")
    handles, labels = a1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, -0.06), ncol=5, fontsize=8, frameon=False)
    fig.suptitle("Policies side by side (same simulated cluster, same workload)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_outputs(out_dir: str, outcome: SimOutcome, keep_token_times: bool = False,
                  telemetry: str | None = None) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    names = ["summary.json", "requests.jsonl", "goodput.png", "latency.png", "capacity.png"]
    multi = len(outcome.config.policies) > 1
    if multi:
        names += ["compare.md", "compare.png"]
    paths = {n: os.path.join(out_dir, n) for n in names}
    summary = dict(outcome.summary)
    summary["capacity_by_tbt"] = capacity_by_tbt(outcome)
    records = outcome.records()
    write_summary_and_records(paths, summary, records, keep_token_times)
    plot_goodput(summary, paths["goodput.png"])
    plot_latency(summary, records, paths["latency.png"])
    plot_capacity(outcome, paths["capacity.png"])
    if multi:
        with open(paths["compare.md"], "w") as f:
            f.write(comparison_table(summary))
        plot_compare(summary, paths["compare.png"])
    if telemetry:
        write_jsonl(telemetry, records)
        paths["telemetry"] = telemetry
    return paths


def format_table(outcome: SimOutcome) -> str:
    """The end-of-run table: one row per (policy, load), then capacities and ratios."""
    s = outcome.summary
    lines = [comparison_table(s).rstrip()]
    unit = "x" if s["load_kind"] == "speedup" else " req/s"
    from ..metrics import describe_capacity

    for t in s.get("targets") or [s]:
        lines.append(f"{t['target']}: {describe_capacity(t['effective_capacity'], unit)}")
    for c in s.get("comparison", []):
        g = [r["goodput_rps_ratio"] for r in c["steps"]]
        lines.append(f"{c['candidate']} / {c['baseline']}: goodput ratio per load "
                     + ", ".join("-" if x is None else f"{x:.2f}" for x in g))
    rb = s.get("reuse_bound")
    if rb:
        lines.append(f"prefix reuse bound: {rb['lru_hit_ratio']:.1%} with the cluster's cache "
                     f"({rb['capacity_tokens']:,} tokens, one global LRU), {rb['infinite_hit_ratio']:.1%} unbounded")
        for t in s.get("targets") or [s]:
            hit, served = t["cached_tokens"]["hit_ratio"], t.get("served_reuse_bound")
            if hit is not None and served:
                lines.append(f"{t['target']}: prefix hit {hit:.1%} of its completed requests' prompt tokens; "
                             f"the same LRU fed only those requests reuses {served:.1%} ({hit / served:.2f} of it)")
    wall = sum(st.stats.wall_s for st in outcome.steps)
    events = sum(st.stats.events for st in outcome.steps)
    sim_s = sum(st.stats.sim_s for st in outcome.steps)
    lines.append(f"simulation: {events:,} events, {sim_s:,.0f} simulated s in {wall:.1f} s of run time "
                 f"({events / max(wall, 1e-9):,.0f} events/s, {sim_s / max(wall, 1e-9):,.0f} simulated s per s)")
    return "\n".join(lines)
