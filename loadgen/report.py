"""Writing a run out: summary.json, requests.jsonl, the two plots, and the end-of-run table."""
from __future__ import annotations

import json
import math
import os
from typing import Any

from predictors.telemetry import RequestRecord

from .metrics import describe_capacity, gaps_summary
from .plots import plot_goodput, plot_latency
from .sweep import RunOutcome, load_label


def _clean(obj: Any) -> Any:
    """JSON-safe: non-finite floats become null (json.dumps would write NaN/Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_summary_and_records(paths: dict[str, str], summary: dict[str, Any], records: list[RequestRecord],
                              keep_token_times: bool) -> None:
    """summary.json and requests.jsonl (gaps summarised per request unless ``keep_token_times``),
    as both ``conductor loadgen`` and ``conductor simulate`` write them."""
    with open(paths["summary.json"], "w") as f:
        json.dump(_clean(summary), f, indent=2)
        f.write("\n")
    with open(paths["requests.jsonl"], "w") as f:
        for r in records:
            d = r.to_dict(token_times=keep_token_times)
            d["extra"] = {**d["extra"], "gaps": gaps_summary(r)}
            f.write(json.dumps(_clean(d)) + "\n")


def write_outputs(out_dir: str, outcome: RunOutcome, keep_token_times: bool = False) -> dict[str, str]:
    """All four files; returns their paths. Without ``keep_token_times`` each request keeps a
    summary of its gaps (``extra.gaps``) instead of every chunk time; ``tbt_s`` and ``tpot_s``
    are written either way."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name)
             for name in ("summary.json", "requests.jsonl", "goodput.png", "latency.png")}
    records = outcome.records()
    write_summary_and_records(paths, outcome.summary, records, keep_token_times)
    plot_goodput(outcome.summary, paths["goodput.png"])
    plot_latency(outcome.summary, records, paths["latency.png"])
    return paths


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}" if x >= 1 else f"{x * 1000:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(summary: dict[str, Any]) -> str:
    """The short end-of-run table: one row per (target, step), then capacity, comparison and
    the client's own lag."""
    targets = summary.get("targets") or [summary]
    multi = len(targets) > 1
    head = (["target"] if multi else []) + ["load", "sent", "ok", "rej", "err", "attain", "goodput/s",
                                            "TTFT p50", "TTFT p99", "TBT p50", "TBT p99", "lag p99"]
    rows = []
    for ti, t in enumerate(targets):
        for s in t["steps"]:
            rows.append(([f"T{ti + 1}"] if multi else []) + [
                load_label(summary["load_kind"], s["load"]), str(s["requests"]), str(s["completed"]),
                str(s["rejected"]),
                str(s["errors"] + s["timeouts"]), _pct(s["slo_attainment"]), _num(s["goodput_rps"]),
                _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p99"]), _ms(s["tbt_s"]["p50"]), _ms(s["tbt_s"]["p99"]),
                "-" if s["client"]["send_lag_ms"]["p99"] is None else f"{s['client']['send_lag_ms']['p99']:.1f}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    lines = [fmt(head), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]
    lines.append("(times in ms; attain = requests meeting the SLO / requests sent; err includes timeouts)")
    unit = "x" if summary["load_kind"] == "speedup" else " req/s"
    for ti, t in enumerate(targets):
        lines.append(("T%d " % (ti + 1) if multi else "") + describe_capacity(t["effective_capacity"], unit))
    for c in summary.get("comparison", []):
        g = [r["goodput_rps_ratio"] for r in c["steps"]]
        lines.append(f"{c['candidate']} / {c['baseline']}: goodput ratio per step "
                     + ", ".join("-" if x is None else f"{x:.2f}" for x in g)
                     + (f"; effective capacity ratio {c['effective_capacity_ratio']:.2f}"
                        if c["effective_capacity_ratio"] else ""))
    for ti, t in enumerate(targets):
        for sp in t.get("spread", []):
            a, g = sp["slo_attainment"], sp["goodput_rps"]
            if a and g:
                lines.append(("T%d " % (ti + 1) if multi else "") + f"{load_label(summary['load_kind'], sp['load'])} "
                             f"over {sp['runs']} runs: attainment {_pct(a['min'])}..{_pct(a['max'])} "
                             f"(mean {_pct(a['mean'])}), goodput {g['min']:.2f}..{g['max']:.2f}/s")
    lines.append(client_line(summary))
    return "\n".join(lines)


def client_line(summary: dict[str, Any]) -> str:
    """The client's own lag, and whether the client (not the target) was the bottleneck."""
    targets = summary.get("targets") or [summary]
    c = summary["client"]
    worst = max((t["client"] for t in targets), key=lambda x: x["send_lag_ms"]["p99"] or 0)
    sl, ll = worst["send_lag_ms"], worst["loop_lag_ms"]
    rates = [s["offered_rps"] for t in targets for s in t["steps"]]
    text = (f"client send lag p50 {sl['p50'] or 0:.2f} ms, p99 {sl['p99'] or 0:.2f} ms, max {sl['max'] or 0:.2f} ms "
            f"(n={sl['n']}, offered up to {max(rates, default=0):.1f} req/s); "
            f"event-loop lag p99 {ll['p99'] or 0:.2f} ms; "
            f"client CPU up to {worst['cpu_util']:.0%} of a core")
    if summary["client_bottleneck"]:
        reasons = "; ".join(t["client"]["reason"] for t in targets if t["client"]["reason"])
        return text + f"\nWARNING: the client was the bottleneck ({reasons}): latencies include client delay"
    return text + f" — the client kept up (p99 lag ≤ {c['max_lag_ms']:g} ms)"
