"""The two plots of a run, readable at a glance: goodput and SLO attainment against load (with
the attainment target and the effective capacity drawn in), and TTFT / TBT distributions (with
the SLOs drawn in). Matplotlib's Agg backend: no display needed."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from predictors.telemetry import RequestRecord  # noqa: E402

from .metrics import describe_capacity  # noqa: E402

_LINESTYLES = ["-", "--", ":", "-."]


def _slo_text(summary: dict) -> str:
    slo = summary["slo"]
    parts = [p for p in (f"TTFT ≤ {slo['ttft_ms']:g} ms" if slo["ttft_ms"] is not None else None,
                         f"TBT ≤ {slo['tbt_ms']:g} ms" if slo["tbt_ms"] is not None else None) if p]
    return "SLO: " + (", ".join(parts) if parts else "none (a request counts when it completes)")


def _load_axis(kind: str) -> tuple[str, str]:
    return ("trace speed-up (×)", "x") if kind == "speedup" else ("request rate asked for (requests/s)", " req/s")


def _targets(summary: dict) -> list[dict]:
    return summary.get("targets") or [summary]


def plot_goodput(summary: dict, path: str) -> None:
    xlabel, unit = _load_axis(summary["load_kind"])
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax2 = ax.twinx()
    handles = []
    target_pct = summary["attainment_target"] * 100
    for i, t in enumerate(_targets(summary)):
        color = f"C{i}"
        name = f" — T{i + 1} {t['target']}" if len(_targets(summary)) > 1 else ""
        loads = [s["load"] for s in t["steps"]]
        good = [s["goodput_rps"] or 0.0 for s in t["steps"]]
        att = [100 * (s["slo_attainment"] or 0.0) for s in t["steps"]]
        handles += ax.plot(loads, good, "o-", color=color, lw=2, label=f"goodput{name}")
        handles += ax2.plot(loads, att, "s--", color=color, alpha=0.7, label=f"SLO attainment{name}")
        cap = t["effective_capacity"]
        if cap["value"] is not None:
            handles.append(ax.axvline(cap["value"], color=color, ls="-.", lw=1.2,
                                      label=describe_capacity(cap, unit).replace(" (attainment", "\n(attainment")))
    handles.append(ax2.axhline(target_pct, color="black", ls=":", lw=1.2, label=f"attainment target {target_pct:g}%"))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("goodput (requests/s meeting the SLO)")
    ax2.set_ylabel("SLO attainment (% of requests sent)")
    ax.set_ylim(bottom=0)
    ax2.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.set_title(f"Goodput and SLO attainment vs load\n{_slo_text(summary)}", fontsize=11)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _ecdf(ax, values: list[float], **kw) -> None:
    v = sorted(values)
    n = len(v)
    ax.step(v, [(i + 1) / n for i in range(n)], where="post", **kw)


def plot_latency(summary: dict, records: list[RequestRecord], path: str) -> None:
    """ECDFs of TTFT and Mooncake TBT for completed requests, one curve per (target, step)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
    kind = summary["load_kind"]
    targets = [t["target"] for t in _targets(summary)]
    loads = sorted({r.extra["load"] for r in records if r.extra.get("load") is not None})
    cmap = plt.get_cmap("viridis")
    ttft_all, drawn = [], 0
    for ti, url in enumerate(targets):
        for li, load in enumerate(loads):
            ok = [r for r in records
                  if r.status == "ok" and r.extra.get("target") == url and r.extra.get("load") == load]
            if not ok:
                continue
            color = cmap(li / max(1, len(loads) - 1) * 0.9)
            label = ((f"T{ti + 1} " if len(targets) > 1 else "")
                     + (f"{load:g}x" if kind == "speedup" else f"{load:g} req/s") + f" (n={len(ok)})")
            ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
            ttft_all += ttft
            _ecdf(a1, ttft, color=color, ls=_LINESTYLES[ti % 4], lw=1.6, label=label)
            tbt = [r.tbt_s * 1000 for r in ok if r.intervals]
            if tbt:
                _ecdf(a2, tbt, color=color, ls=_LINESTYLES[ti % 4], lw=1.6, label=label)
            drawn += 1
    slo = summary["slo"]
    for ax, key, name in ((a1, "ttft_ms", "TTFT"), (a2, "tbt_ms", "TBT")):
        if slo[key] is not None:
            ax.axvline(slo[key], color="red", ls="--", lw=1.5, label=f"{name} SLO {slo[key]:g} ms")
        ax.set_ylabel("fraction of completed requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8, loc="lower right")
        else:
            ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
    if ttft_all and min(ttft_all) > 0 and max(ttft_all) / min(ttft_all) > 100:
        a1.set_xscale("log")
    a1.set_xlabel("TTFT: request sent → first token (ms)")
    a2.set_xlabel("TBT: mean of the slowest 10% of a request's token gaps (ms)")
    a1.set_title("Time to first token")
    a2.set_title("Time between tokens (Mooncake TBT)")
    fig.suptitle(f"Latency distributions (CDF) — {_slo_text(summary)}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
