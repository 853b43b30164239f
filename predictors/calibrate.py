"""``conductor calibrate``: fit the learned predictors from RequestRecord telemetry, score them on
held-out requests against the analytic prior, and write the models (plain JSON), metrics.json,
report.md and plots.

    conductor calibrate --telemetry FILE [FILE...] --out DIR [--holdout time|random]
                        [--holdout-fraction 0.2] [--quantile 0.9] [--deployment NAME]

The models served are refitted on every row (training and held-out) once the held-out scores
are taken; the scores are those of the model fitted without the held-out rows. A fit on the
shortest 90% of prompts, scored on the longest 10%, measures extrapolation.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import numpy as np

from predictors.cli_args import CLIError, Parser
from predictors.dataset import DataError, Dataset, build_dataset
from predictors.fit import MIN_ROWS, Scored, fit_all, metrics_of, score
from predictors.learned_models import TBT_KV_SHARE, LearnedModels
from predictors.online_quantile import replay, tune_eta
from predictors.telemetry import RequestRecord, read_jsonl


def build_parser() -> Parser:
    p = Parser(prog="conductor calibrate", description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--telemetry", nargs="+", required=True, metavar="FILE",
                   help="RequestRecord JSONL: the gateway's telemetry_path or conductor simulate --telemetry")
    p.add_argument("--out", required=True, metavar="DIR", help="where models.json, metrics.json, report.md go")
    p.add_argument("--holdout", choices=("time", "random"), default="time",
                   help="held-out requests: the latest (time, default) or a random share")
    p.add_argument("--holdout-fraction", type=float, default=0.2, metavar="F", help="share held out (default 0.2)")
    p.add_argument("--quantile", type=float, default=0.9, metavar="Q", help="the upper quantile fitted (default 0.9)")
    p.add_argument("--deployment", metavar="NAME", help="public deployment of records that do not name one")
    p.add_argument("--min-rows", type=int, default=MIN_ROWS, help=f"rows a model needs (default {MIN_ROWS})")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--seed", type=int, default=0, help="seed of --holdout random")
    return p


def read_records(paths: list[str]) -> list[RequestRecord]:
    out: list[RequestRecord] = []
    for k, path in enumerate(paths):
        try:
            for r in read_jsonl(path):
                r.extra["source"] = k  # each file its own run (its own clock and instances)
                out.append(r)
        except FileNotFoundError:
            raise CLIError(f"--telemetry {path}: no such file") from None
        except (json.JSONDecodeError, TypeError) as e:
            raise CLIError(f"--telemetry {path}: not RequestRecord JSONL ({e})") from None
    return out


def split(ds: Dataset, how: str, fraction: float, seed: int) -> tuple[Any, Any]:
    """(train(t), held(row)) predicates over a row's position in its run: the latest ``fraction``
    of every run, or a random share."""
    ts = sorted({q.t for q in ds.queue} | {b.t for b in ds.tbt} | {p.t for p in ds.prefill})
    if how == "time":
        cut = ts[min(len(ts) - 1, int(len(ts) * (1 - fraction)))]
        return (lambda t: t < cut), (lambda row: row.t >= cut)
    rng = random.Random(seed)
    held = {t for t in ts if rng.random() < fraction}
    return (lambda t: t not in held), (lambda row: row.t in held)


def _fmt(x: Any) -> str:
    return "—" if x is None else (f"{x:.1%}" if isinstance(x, float) else str(x))


def report_md(metrics: dict[str, Any]) -> str:
    lines = ["# Calibration report", "", f"Telemetry: {', '.join(metrics['telemetry'])}; {metrics['records']} records, "
             f"{metrics['used']} finished and placed. Held out: {metrics['holdout']} "
             f"({metrics['holdout_fraction']:.0%}). Rows: " + ", ".join(f"{k} {v}" for k, v in metrics["rows"].items()),
             "", "## Held-out error, learned vs the analytic prior", "",
             "| term | n | learned MAPE | APE p50 | APE p90 | p90 coverage static | served (tracked) | analytic MAPE "
             "| analytic APE p50 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for term, m in metrics["holdout_metrics"].items():
        lm, am = m["learned"], m["analytic"]
        lines.append(f"| {term} | {lm.get('n', 0)} | {_fmt(lm.get('mape'))} | {_fmt(lm.get('ape_p50'))} | "
                     f"{_fmt(lm.get('ape_p90'))} | {_fmt(lm.get('p90_coverage'))} | "
                     f"{_fmt(lm.get('p90_coverage_served'))} | {_fmt(am.get('mape'))} | {_fmt(am.get('ape_p50'))} |")
    oq = metrics.get("online_quantile")
    if oq:
        lines += ["", f"p90 coverage *static*: the calibrated (conformal) quantile alone; *served*: the same times the "
                  f"online quantile tracker's scale (predictors/online_quantile.py, step {oq['eta']:g} tuned on the "
                  "training rows), the held-out rows replayed in decision order from scale 1, each outcome applied "
                  "only once its request had ended."]
    ex = metrics.get("extrapolation") or {}
    if ex:
        lines += ["", f"## Extrapolation: fitted on prompts up to {ex['max_prompt_tokens']} tokens, "
                  "scored on longer ones",
                  "", "| term | n | learned MAPE | analytic MAPE |", "|---|---:|---:|---:|"]
        for term, m in ex["metrics"].items():
            lines.append(f"| {term} | {m['learned'].get('n', 0)} | {_fmt(m['learned'].get('mape'))} | "
                         f"{_fmt(m['analytic'].get('mape'))} |")
    lines += ["", "## Terms", ""]
    for term, info in metrics["models"].items():
        lines.append(f"- **{term}**: {info}")
    for term, why in metrics["missing"].items():
        lines.append(f"- **{term}**: not fitted ({why}); the analytic prior answers it")
    lines += ["", "prefill rows are scored on lone prefills only (the instance idle, nobody joining); handover is the "
              "KV shipment plus the first decode step; TTFT rebuilds each request's queue from the requests ahead of "
              "it, with each predictor's own prefill times, and adds the decode wait its decision predicted (the "
              "same for both).", ""]
    return "\n".join(lines)


def plots(out: str, scored: dict[str, Scored], q: float) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[str] = []
    terms = [t for t, s in scored.items() if len(s.actual)]
    if not terms:
        return paths
    fig, axes = plt.subplots(1, len(terms), figsize=(4.2 * len(terms), 4), squeeze=False)
    for ax, t in zip(axes[0], terms, strict=False):
        s = scored[t]
        ax.loglog(s.actual, s.analytic, ".", ms=3, alpha=0.5, label="analytic")
        ax.loglog(s.actual, s.learned, ".", ms=3, alpha=0.6, label="learned")
        lo, hi = float(s.actual.min()), float(s.actual.max())
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.set(title=t, xlabel="actual (s)", ylabel="predicted (s)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "predicted_vs_actual.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(terms), figsize=(4.2 * len(terms), 4), squeeze=False)
    for ax, t in zip(axes[0], terms, strict=False):
        s = scored[t]
        for name, pred in (("analytic", s.analytic), ("learned", s.learned)):
            e = np.sort(np.abs(pred - s.actual) / np.maximum(s.actual, 1e-12))
            ax.plot(e, np.arange(1, len(e) + 1) / len(e), label=name)
        ax.set(title=f"{t}: error CDF", xlabel="absolute percentage error", xlim=(0, 1))
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "error_cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for t in terms:
        s = scored[t]
        order = np.argsort(s.t)
        hit = (s.actual[order] <= s.learned_p90[order]).astype(float)
        k = max(1, len(hit) // 20)
        ax.plot(s.t[order][k - 1:], np.convolve(hit, np.ones(k) / k, mode="valid"), label=t)
    ax.axhline(q, color="k", lw=0.8, ls="--")
    ax.set(title=f"p{q * 100:g} coverage over time (rolling, held-out)", xlabel="position in its run (decision time)",
           ylim=(0, 1.02))
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out, "coverage_over_time.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


#: Terms whose upper quantile the serving path tracks online (LearnedBundle.observe).
TRACKED = ("prefill", "tbt", "handover", "ttft")


def served_coverage(held: dict[str, Scored], training: dict[str, Scored], q: float,
                    holdout_metrics: dict[str, Any]) -> dict[str, Any]:
    """Tune the tracker's step on the training rows' replay (never the held-out ones), replay the
    held-out rows with it, and add each tracked term's served coverage and pinball loss to
    ``holdout_metrics`` beside the static ones. Returns the step and how it was chosen."""
    def stream(s: Scored) -> tuple[list[str], np.ndarray, np.ndarray, list[str], np.ndarray, np.ndarray]:
        return s.run, s.decided, s.known, s.key, s.actual, s.learned_p90

    streams = [stream(training[t]) for t in TRACKED if t in training]
    eta, errors = tune_eta(streams, q, blocks=TUNE_BLOCKS)
    for t in TRACKED:
        if t not in held or t not in holdout_metrics or not len(held[t].actual):
            continue
        s = held[t]
        served = replay(s.run, s.decided, s.known, s.key, s.actual, s.learned_p90, q, eta)
        d = s.actual - served
        holdout_metrics[t]["learned"]["p90_coverage_served"] = float(np.mean(s.actual <= served))
        holdout_metrics[t]["learned"]["pinball_p90_served"] = float(np.mean(np.maximum(q * d, (q - 1) * d)))
    return {"eta": eta, "tuned_on": "training rows (replayed in decision order)", "blocks": TUNE_BLOCKS,
            "block_rms_error": {str(k): round(v, 5) for k, v in errors.items()}}


#: Stretches of each run's training rows the step is tuned over (a 20% hold-out is a quarter of the rest).
TUNE_BLOCKS = 4
#: Held-out rows a term needs before it can be judged worse than the prior (and left to it).
MIN_JUDGED_ROWS = 10
#: Where each term's held-out score is (a load is judged alone: the leg minus the learned prefill).
_SCORED_AS = {"prefill": "prefill", "tbt": "tbt", "transfer": "handover", "store": "store_load", "host": "host_load"}


def _worse_than_prior(holdout_metrics: dict[str, Any]) -> dict[str, str]:
    """Terms whose held-out MAPE is above the analytic prior's: the prior keeps answering them."""
    out = {}
    for term, key in _SCORED_AS.items():
        m = holdout_metrics.get(key)
        if not m or m["learned"].get("n", 0) < MIN_JUDGED_ROWS:
            continue
        lm, am = m["learned"].get("mape"), m["analytic"].get("mape")
        if lm is not None and am is not None and lm > am:
            out[term] = (f"held-out MAPE {lm:.1%} over {m['learned']['n']} rows is worse than the analytic prior's "
                         f"{am:.1%}")
    return out


def calibrate(records: list[RequestRecord], out: str, *, holdout: str = "time", fraction: float = 0.2,
              q: float = 0.9, deployment: str | None = None, min_rows: int = MIN_ROWS, seed: int = 0,
              telemetry: list[str] | None = None, draw: bool = True, log: Any = None) -> dict[str, Any]:
    """Fit, score and write; returns metrics.json's content. DataError on unusable telemetry."""
    say = log or (lambda msg: None)
    t0 = time.perf_counter()
    ds = build_dataset(records, deployment)
    rows = {"prefill": len(ds.prefill), "prefill_clean": sum(r.clean for r in ds.prefill), "tbt": len(ds.tbt),
            "handover": len(ds.handover), "queue": len(ds.queue)}
    say(f"{len(records)} records, {ds.used} usable; rows: " + ", ".join(f"{k} {v}" for k, v in rows.items()))
    train, held = split(ds, holdout, fraction, seed)
    # the conformal folds are cut like the hold-out: contiguous stretches of each run when it is
    # the latest part (the drift within a run stays inside a fold), random positions otherwise
    folds = "blocked" if holdout == "time" else "cv"
    trial, missing = fit_all(ds, train, q, min_rows=min_rows, calibration=folds, seed=seed)
    if not trial.terms:
        raise DataError("too little data to fit any term: " + "; ".join(f"{k}: {v}" for k, v in missing.items()))
    scored = score(trial, ds, held)
    holdout_metrics = metrics_of(scored)
    # served coverage: the online quantile tracker's step tuned on the training rows, then the
    # held-out rows replayed in decision order (predictors/online_quantile.py)
    tracking = served_coverage(scored, score(trial, ds, lambda row: train(row.t)), q, holdout_metrics)
    # extrapolation: fit on the shortest 90% of prompts, score on the longest 10%
    prompts = np.array([r.prompt_tokens for r in ds.queue] or [0])
    p90_prompt = int(np.quantile(prompts, 0.9))
    short, _ = fit_all(ds, None, q, max_prompt=p90_prompt, min_rows=min_rows, quantiles=False)
    extrapolation = {}
    if short.terms:
        ex = score(short, ds, lambda row: row.prompt_tokens > p90_prompt)
        extrapolation = {"max_prompt_tokens": p90_prompt, "metrics": metrics_of(ex)}
    final, missing = fit_all(ds, None, q, min_rows=min_rows, calibration=folds, seed=seed)
    worse = _worse_than_prior(holdout_metrics)  # a learned term that loses to the prior held out is not served
    final = LearnedModels({t: m for t, m in final.terms.items() if t not in worse}, final.meta, final.ttft_p90_scale)
    missing.update(worse)
    final = LearnedModels(final.terms, {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                        "telemetry": telemetry or [], "records": len(records), "quantile": q,
                                        "deployments": sorted(ds.deployments), **final.meta,
                                        # its TBT rows read a full cache at their recorded KV share (serve it so)
                                        TBT_KV_SHARE: ds.kv_share_recorded,
                                        "online_quantile": {"eta": tracking["eta"]}},
                          final.ttft_p90_scale)
    os.makedirs(out, exist_ok=True)
    models_path = final.save(out)
    models_info = {t: (f"pooled over {m.pooled.n} rows" if m.pooled else "no pooled model")
                   + (f"; groups: {', '.join(f'{g} ({gm.n} rows)' for g, gm in m.groups.items())}" if m.groups else "")
                   for t, m in final.terms.items()}
    metrics: dict[str, Any] = {
        "telemetry": telemetry or [], "records": len(records), "used": ds.used, "skipped": ds.skipped, "rows": rows,
        "holdout": holdout, "holdout_fraction": fraction, "quantile": q, "holdout_metrics": holdout_metrics,
        "extrapolation": extrapolation, "online_quantile": tracking, "models": models_info, "missing": missing,
        "fit_seconds": time.perf_counter() - t0}
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report_md(metrics))
    paths = [models_path, os.path.join(out, "metrics.json"), os.path.join(out, "report.md")]
    if draw:
        paths += plots(out, scored, q)
    metrics["written"] = paths
    return metrics


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    if not 0 < a.holdout_fraction < 1:
        raise CLIError(f"--holdout-fraction must be between 0 and 1, got {a.holdout_fraction}")
    if not 0.5 <= a.quantile < 1:
        raise CLIError(f"--quantile must be in [0.5, 1), got {a.quantile}")
    if a.min_rows < 5:
        raise CLIError("--min-rows must be at least 5")
    records = read_records(a.telemetry)
    if not records:
        raise CLIError(f"no records in {', '.join(a.telemetry)}")
    try:
        m = calibrate(records, a.out, holdout=a.holdout, fraction=a.holdout_fraction, q=a.quantile,
                      deployment=a.deployment, min_rows=a.min_rows, seed=a.seed, telemetry=a.telemetry,
                      draw=not a.no_plots, log=lambda s: print(s, file=sys.stderr, flush=True))
    except DataError as e:
        raise CLIError(str(e)) from None
    print(report_md(m))
    for term, why in m["missing"].items():
        print(f"warning: {term} not fitted ({why}); the analytic prior answers it", file=sys.stderr)
    print("wrote " + ", ".join(m["written"]))
    return 0
