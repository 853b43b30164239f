"""Experiment 2: effective request capacity against the TBT threshold (the paper's end-to-end
figure): conductor on a disaggregated P/D cluster against a colocated vLLM-like cluster of the
same number of instances (prefix caching and chunked prefill on in both), on the Mooncake
conversation trace and on the Azure code trace.

    .venv/bin/python bench/experiments/capacity.py [--limit-conversation 1000] [--workers 2]

Effective capacity = the highest trace speed-up at which >= 90% of requests meet TTFT <= 30 s and
TBT <= threshold (TBT = mean of a request's slowest 10% of token gaps), interpolated between the
speed-ups swept. Writes docs/experiments/capacity.md, docs/experiments/capacity/ (capacity_*.png,
attainment_*.png, results.json) and the full outputs to out/experiments/capacity/.
"""
from __future__ import annotations

import argparse

import _common as C
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadgen.simulate.report import capacity_by_tbt  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402

PAPER_GAIN = {"conversation": {100: 4.98, 200: 1.57, 300: 0.59}, "azure_code": {}}
LOADS = {"conversation": "0.25,0.5,0.75,1,1.25,1.5,2", "azure_code": "1,2,4,8,12,16,24,32"}
PLOT_TBT = tuple(range(50, 425, 25))

DISCUSSION = """## Discussion

(hand-written; kept when the command regenerates the block above)
"""


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit-conversation", type=int, default=1000, help="first N requests (0: the whole trace)")
    p.add_argument("--limit-azure-code", type=int, default=0,
                   help="first N requests (0, the default: the whole trace; a short slice at a high speed-up "
                        "lasts less than the TTFT SLO, so no queue can break it)")
    p.add_argument("--traces", default="conversation,azure_code")
    p.add_argument("--loads-conversation", default=LOADS["conversation"], help="speed-ups swept")
    p.add_argument("--loads-azure-code", default=LOADS["azure_code"], help="speed-ups swept")
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--baseline", default="least_loaded", help="policy of the colocated cluster")
    p.add_argument("--colocated-chunks", default="2048,8192",
                   help="chunked-prefill token budgets of the colocated baseline, one sweep each")
    p.add_argument("--slo-ttft-s", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    both = a.prefill + a.decode
    slo = SLO(a.slo_ttft_s, 0.1)
    figs = C.DOCS / "capacity"
    chunks = [int(x) for x in a.colocated_chunks.split(",") if x.strip()]
    sections, results = [], {}
    for trace in [t.strip() for t in a.traces.split(",") if t.strip()]:
        loads = floats(getattr(a, "loads_" + trace))
        base = C.load_trace(trace, getattr(a, "limit_" + trace) or None)
        out = C.OUT / "capacity" / trace
        runs = {"pd": C.sweep(base, C.cluster(a.prefill, a.decode), ["conductor"], loads=loads, metric_slo=slo,
                              workers=a.workers, out=out / "pd")}
        names = {"pd": f"conductor, {a.prefill}P+{a.decode}D"}
        for ch in chunks:
            spec = C.cluster(both=both)
            spec.engine["max_num_batched_tokens"] = ch
            runs[f"co{ch}"] = C.sweep(base, spec, [a.baseline], loads=loads, metric_slo=slo, workers=a.workers,
                                      out=out / f"colocated-{ch}")
            names[f"co{ch}"] = f"{a.baseline}, {both} colocated, chunk {ch}"
        cap = {k: next(iter(capacity_by_tbt(o).values())) for k, o in runs.items()}
        fine = {k: next(iter(capacity_by_tbt(o, PLOT_TBT).values())) for k, o in runs.items()}
        rows, res = [], []
        for i, r_pd in enumerate(cap["pd"]):
            ms = r_pd["tbt_ms"]
            v_pd = r_pd["effective_capacity"]["value"]
            paper = PAPER_GAIN[trace].get(ms)
            row = [f"{ms} ms", describe(r_pd["effective_capacity"])]
            gains = {}
            for ch in chunks:
                r_co = cap[f"co{ch}"][i]
                v_co = r_co["effective_capacity"]["value"]
                gains[ch] = None if not v_pd or not v_co else v_pd / v_co - 1
                row += [describe(r_co["effective_capacity"]), gain_text(r_pd["effective_capacity"],
                                                                        r_co["effective_capacity"])]
            row.append("-" if paper is None else f"+{100 * paper:.0f}%")
            rows.append(row)
            res.append({"tbt_ms": ms, "pd": r_pd, "colocated": {ch: cap[f"co{ch}"][i] for ch in chunks},
                        "gain": gains, "paper_gain": paper})
        results[trace] = {"loads": loads, "requests": len(base.requests), "span_s": base.span_s, "rows": res}
        plot_capacity(fine, names, figs / f"capacity_{trace}.png", trace, len(base.requests))
        plot_attainment(runs, names, figs / f"attainment_{trace}.png", trace)
        heads = ["TBT threshold", f"capacity: {names['pd']}"]
        for ch in chunks:
            heads += [f"capacity: colocated, chunk {ch}", f"gain vs chunk {ch}"]
        heads.append("gain (paper)")
        att = C.md_table(["system"] + [f"{x:g}x" for x in loads] + ["TTFT mean (s)", "TBT p90 (ms)", "prefix hit"],
                         [[names[k]] + [" / ".join(C.pct(r["attainment"][j]) for r in cap[k])
                                        for j in range(len(loads))]
                          + [C.sec(o.summary["ttft_s"]["mean"]), C.sec(1000 * (o.summary["tbt_s"]["p90"] or 0), 0),
                             C.pct(o.summary["cached_tokens"]["hit_ratio"])] for k, o in runs.items()])
        sections.append(f"""### {trace} (`{C.TRACES[trace].relative_to(C.ROOT)}`)

First {len(base.requests)} requests ({base.span_s:.0f} s of trace time at 1x,
{len(base.requests) / max(base.span_s, 1e-9):.2f} requests/s); speed-ups swept: {', '.join(f'{x:g}x' for x in loads)}.

""" + C.md_table(heads, rows) + """
Effective requests per speed-up (at TBT 100 / 200 / 300 ms), and over the whole sweep the mean
TTFT, TBT p90 and prefix-hit ratio:

""" + att + f"""
![effective capacity vs TBT threshold, {trace}](capacity/capacity_{trace}.png)
![attainment vs speed-up, {trace}](capacity/attainment_{trace}.png)
""")
    C.save_json(figs / "results.json", {"profile": C.PROFILE, "baseline": a.baseline,
                                        "cluster": {"pd": [a.prefill, a.decode], "colocated": both},
                                        "colocated_chunks": chunks, "results": results})
    gen = f"""
**Command** (regenerates this block, the figures and results.json):

```
{C.command_line()}
```

**Setup.** `{C.PROFILE}` instances (LLaMA3-70B, 8 x A800 each): conductor on {a.prefill} prefill +
{a.decode} decode instances against {both} colocated (`--both`) instances routed by `{a.baseline}`
(the vLLM-like baseline: every instance prefills and decodes, with chunked prefill and prefix
caching, as in vLLM; one sweep per chunked-prefill token budget: {a.colocated_chunks}). Same total
GPUs, same requests, analytic predictors, no admission control (every request is served; the SLO
is only measured). A request
is *effective* when TTFT <= {a.slo_ttft_s:g} s and its TBT (mean of its slowest 10% of token gaps) <= the
threshold; the effective capacity is the highest speed-up with >= 90% effective requests
(linear between swept speed-ups; "≥ X" = met at every speed-up tried, "< X" = missed at the lowest).

""" + "\n".join(sections)
    C.write_doc(C.DOCS / "capacity.md", "Experiment 2: effective request capacity vs TBT threshold", gen, DISCUSSION)
    print(f"wrote {C.DOCS / 'capacity.md'}")


def gain_text(pd: dict, co: dict) -> str:
    """capacity(P/D) / capacity(colocated) - 1, with bounds when a sweep did not bracket a capacity."""
    v_pd, v_co = pd["value"], co["value"]
    if pd["method"] == co["method"] == "lower_bound":
        return "-"  # neither reached its capacity in the sweep
    if v_pd and v_co:
        g = f"{100 * (v_pd / v_co - 1):+.0f}%"
        return ("≥ " + g) if pd["method"] == "lower_bound" and co["method"] != "lower_bound" else g
    if v_pd and co["method"] == "below_range":
        return f"> {100 * (v_pd / co['between'][1] - 1):+.0f}%"
    return "-"


def describe(cap: dict) -> str:
    v, m = cap["value"], cap["method"]
    if m == "below_range":
        return f"< {cap['between'][1]:g}x"
    if m == "lower_bound":
        return f"≥ {v:g}x"
    return "-" if v is None else f"{v:.2f}x"


def plot_capacity(fine, names, path, trace, limit) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (key, rows) in enumerate(fine.items()):
        ax.plot([r["tbt_ms"] for r in rows], [r["effective_capacity"]["value"] or 0.0 for r in rows], "o-",
                color=f"C{i}", lw=2, label=names[key])
    ax.set_xlabel("TBT threshold (ms)")
    ax.set_ylabel("effective capacity (trace speed-up with ≥ 90% effective requests)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Effective request capacity, {trace} (first {limit} requests), {C.PROFILE}; 0 = below the sweep",
                 fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_attainment(runs, names, path, trace) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (key, outcome) in enumerate(runs.items()):
        rows = next(iter(capacity_by_tbt(outcome).values()))
        loads = sorted(outcome.config.loads)
        for r, style in zip(rows, ("-", "--", ":"), strict=True):
            ax.plot(loads, [100 * (x or 0) for x in r["attainment"]], style, marker="o", color=f"C{i}",
                    label=f"{names[key]}, TBT ≤ {r['tbt_ms']} ms")
    ax.axhline(90, color="grey", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("trace speed-up")
    ax.set_ylabel("effective requests (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"Effective requests vs load, {trace}", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
