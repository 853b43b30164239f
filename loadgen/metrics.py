"""Run metrics from per-request records (SCHEDULING.md §3) and the effective capacity of a sweep.

* SLO attainment = requests meeting every SLO / requests sent (rejections, errors and timeouts
  count as misses; requests never sent because the run was aborted are left out).
* Goodput = requests meeting every SLO / step duration (first arrival to last response, over
  the requests sent).
* Percentiles (linear interpolation, numpy's default) always come with their ``n``.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from predictors.telemetry import SLO, RequestRecord

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist(values: Sequence[float]) -> dict[str, Any]:
    """``{"n", "mean", "p50", "p90", "p99", "max"}`` of a sample (None when empty)."""
    vals = list(values)
    out: dict[str, Any] = {"n": len(vals)}
    out["mean"] = sum(vals) / len(vals) if vals else None
    for q in QUANTILES:
        out[f"p{q}"] = percentile(vals, q)
    out["max"] = max(vals) if vals else None
    return out


def gaps_summary(rec: RequestRecord) -> dict[str, Any]:
    """A request's inter-token gaps in short: what requests.jsonl keeps instead of every time."""
    return dist(rec.intervals)


def step_duration(records: Sequence[RequestRecord]) -> float:
    """First arrival to the last thing that happened (a response end, or a send); pass the
    requests that were sent."""
    if not records:
        return 0.0
    start = min(r.arrival_s for r in records)
    end = max(max(t for t in (r.end_s, r.first_token_s, r.sent_s, r.arrival_s) if t is not None) for r in records)
    return end - start


def summarize(records: Sequence[RequestRecord], slo: SLO, duration_s: float | None = None) -> dict[str, Any]:
    """Counts, attainment, goodput and latency distributions of one step (or any set of records)."""
    sent = [r for r in records if r.status != "aborted"]
    ok = [r for r in sent if r.status == "ok"]
    met = [r for r in ok if r.meets(slo)]
    dur = step_duration(sent) if duration_s is None else duration_s
    statuses = Counter(r.status for r in records)
    out_tokens = sum(r.output_tokens for r in ok)
    reported = [r for r in ok if r.extra.get("usage_prompt_tokens") is not None]
    mismatched = [r for r in reported if r.extra["usage_prompt_tokens"] != r.prompt_tokens]
    cached = [(r.cached_tokens, r.prompt_tokens) for r in ok if r.cached_tokens is not None]
    summary: dict[str, Any] = {
        "requests": len(sent),
        "completed": len(ok),
        "rejected": statuses["rejected"],
        "errors": statuses["error"],
        "timeouts": statuses["timeout"],
        "aborted": statuses["aborted"],
        "slo": {"ttft_ms": None if slo.ttft_s is None else slo.ttft_s * 1000,
                "tbt_ms": None if slo.tbt_s is None else slo.tbt_s * 1000},
        "slo_met": len(met),
        "slo_attainment": len(met) / len(sent) if sent else None,
        "goodput_rps": len(met) / dur if dur > 0 else None,
        "duration_s": dur,
        "throughput_rps": len(ok) / dur if dur > 0 else None,
        "output_tokens_per_s": out_tokens / dur if dur > 0 else None,
        "ttft_s": dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tbt_s": dist([r.tbt_s for r in ok if r.intervals]),
        "tpot_s": dist([r.tpot_s for r in ok if r.output_tokens > 1]),
        "itl_s": dist([g for r in ok for g in r.intervals]),
        "e2e_s": dist([r.e2e_s for r in ok if r.e2e_s is not None]),
        "output_tokens": out_tokens,
        "prompt_tokens": {
            "sent": sum(r.prompt_tokens for r in sent),
            "reported_by_target": sum(r.extra["usage_prompt_tokens"] for r in reported) if reported else None,
            "requests_checked": len(reported),
            "requests_mismatched": len(mismatched),
            "max_abs_error": max((abs(r.extra["usage_prompt_tokens"] - r.prompt_tokens) for r in mismatched),
                                 default=0),
        },
        "cached_tokens": {
            "reported": sum(c for c, _ in cached) if cached else None,
            "hit_ratio": sum(c for c, _ in cached) / max(1, sum(p for _, p in cached)) if cached else None,
        },
        "reject_reasons": dict(Counter(r.reject_reason or "unspecified" for r in records if r.status == "rejected")),
        "error_samples": sorted({r.error for r in records if r.status in ("error", "timeout") and r.error})[:3],
    }
    return summary


def effective_capacity(loads: Sequence[float], attainments: Sequence[float | None],
                       target: float = 0.9) -> dict[str, Any]:
    """The highest load whose SLO attainment stays >= ``target``, reading the sweep upwards.

    Between the last load that meets the target and the first that does not, the crossing is
    linearly interpolated (``method: "interpolated"``). When every load meets it the capacity is
    at least the highest load (``"lower_bound"``); when none does, below the lowest (``"below_range"``).
    """
    by_load: dict[float, list[float]] = {}
    for load, a in zip(loads, attainments, strict=True):
        if a is not None:
            by_load.setdefault(load, []).append(a)
    pts = sorted((load, sum(a) / len(a)) for load, a in by_load.items())  # a repeated load: its mean
    res: dict[str, Any] = {"target": target, "value": None, "method": None, "between": None}
    if not pts:
        res["method"] = "no_data"
        return res
    if pts[0][1] < target:
        res.update(method="below_range", between=[0.0, pts[0][0]])
        return res
    for (l0, a0), (l1, a1) in pairwise(pts):
        if a1 < target:
            x = l0 if a0 == a1 else l0 + (l1 - l0) * (a0 - target) / (a0 - a1)
            res.update(value=x, method="interpolated", between=[l0, l1])
            return res
    res.update(value=pts[-1][0], method="lower_bound", between=[pts[-1][0], None])
    return res


def describe_capacity(cap: dict[str, Any], unit: str) -> str:
    """One line for tables and plot labels."""
    t = f"{cap['target'] * 100:g}%"
    m = cap["method"]
    if m == "interpolated":
        lo, hi = cap["between"]
        return (f"effective capacity ≈ {cap['value']:.3g}{unit} "
                f"(attainment ≥ {t}; interpolated between {lo:g} and {hi:g})")
    if m == "lower_bound":
        return f"effective capacity ≥ {cap['value']:g}{unit} (attainment ≥ {t} at every load tried)"
    if m == "below_range":
        return f"effective capacity < {cap['between'][1]:g}{unit} (attainment < {t} at every load tried)"
    return "effective capacity: no data"
