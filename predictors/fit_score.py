"""Scoring the learned predictors: each term's learned and analytic predictions against what
happened on the rows a hold-out selects, and the TTFT they add up to (Mooncake's queue rebuilt
from the requests ahead), with the per-row facts the online quantile tracker replays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from predictors.dataset import Dataset, known_at, reconstructed_queue, run_of
from predictors.fit_matrices import LOADS, Physics, first_step, load_rows, predict, raw_upper
from predictors.fit_weights import P90
from predictors.learned_features import group_of
from predictors.learned_models import LearnedModels


def _ape(pred: np.ndarray, actual: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.abs(pred - actual) / np.maximum(actual, 1e-12)
    return out


def summary(pred: np.ndarray, actual: np.ndarray, p90: np.ndarray | None = None) -> dict[str, Any]:
    if len(actual) == 0:
        return {"n": 0}
    ape = _ape(pred, actual)
    out: dict[str, Any] = {"n": int(len(actual)), "mape": float(ape.mean()), "ape_p50": float(np.quantile(ape, 0.5)),
                           "ape_p90": float(np.quantile(ape, 0.9)), "ape_p99": float(np.quantile(ape, 0.99)),
                           "median_signed": float(np.median(pred / np.maximum(actual, 1e-12) - 1))}
    if p90 is not None:
        out["p90_coverage"] = float(np.mean(actual <= p90))
        d = actual - p90
        out["pinball_p90"] = float(np.mean(np.maximum(P90 * d, (P90 - 1) * d)))
    return out


@dataclass
class Scored:
    """Per-row predictions of one term on some rows (for metrics and plots)."""

    t: np.ndarray
    actual: np.ndarray
    learned: np.ndarray
    learned_p90: np.ndarray
    analytic: np.ndarray
    prompt: np.ndarray
    learned_p90_raw: np.ndarray  # the fitted quantile before its conformal scale (without the offset)
    offset: np.ndarray  # what the term adds to its own model (the handover's first decode step)
    # for the online quantile tracker's replay (predictors/online_quantile.py): each row's run,
    # decision and outcome times, and the tracker's key (its deployment group; the TTFT: "all")
    run: list[str] = field(default_factory=list)
    decided: np.ndarray = field(default_factory=lambda: np.zeros(0))
    known: np.ndarray = field(default_factory=lambda: np.zeros(0))
    key: list[str] = field(default_factory=list)


def score(models: LearnedModels, ds: Dataset, keep: Callable[[Any], bool], ttft: bool = True) -> dict[str, Scored]:
    """Learned and analytic predictions of each term on the rows ``keep(row)`` selects (and of the
    TTFT, unless ``ttft`` is False: it rebuilds every request's queue, the costly part)."""
    ph = Physics(ds.deployments)
    out: dict[str, Scored] = {}

    def pack(rows: Sequence[tuple[float, ...]], meta: Sequence[tuple[str, float, float, str]] = ()) -> Scored:
        a = np.array([r + (0.0,) * (8 - len(r)) for r in rows], dtype=float).reshape(-1, 8)
        m = list(meta) if len(meta) == len(rows) else [("", 0.0, 0.0, "")] * len(rows)
        return Scored(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], a[:, 5].astype(int), a[:, 6], a[:, 7],
                      [x[0] for x in m], np.array([x[1] for x in m], dtype=float),
                      np.array([x[2] for x in m], dtype=float), [x[3] for x in m])

    tm = models.terms.get("prefill")
    if tm is not None:
        rows: list[tuple[float, ...]] = []
        meta: list[tuple[str, float, float, str]] = []
        for r in ds.prefill:
            if keep(r) and r.clean:
                x = ph.prefill_x(r.deployment, r.items)
                p, p9 = predict(tm, r.deployment, x)
                rows.append((r.t, r.service_s, p, p9, ph.analytic_prefill(r.deployment, r.items), r.prompt_tokens,
                             raw_upper(tm, r.deployment, x)))
                meta.append((r.run, r.decided_s, r.known_s, group_of(r.deployment)))
        out["prefill"] = pack(rows, meta)
    tm = models.terms.get("tbt")
    if tm is not None:
        rows, meta = [], []
        for b in ds.tbt:
            if keep(b):
                meta.append((b.run, b.decided_s, b.known_s, group_of(b.deployment)))
                x = ph.tbt_x(b.deployment, b.running, b.kv_tokens, b.prompt_tokens, b.max_tokens, b.cluster_running,
                             b.kv_share)
                p, p9 = predict(tm, b.deployment, x)
                rows.append((b.t, b.tbt_s, p, p9, ph.analytic_tbt(b.deployment, b.running, b.kv_tokens,
                                                                  b.prompt_tokens, b.max_tokens, b.kv_share),
                             b.prompt_tokens,
                             raw_upper(tm, b.deployment, x)))
        out["tbt"] = pack(rows, meta)
    tm = models.terms.get("transfer")
    if tm is not None:
        rows, meta = [], []
        for h in ds.handover:
            if keep(h):
                meta.append((h.run, h.decided_s, h.known_s, group_of(h.dst_deployment)))
                step = first_step(models, ph, h)
                x = ph.transfer_x(h.src_deployment, h.dst_deployment, h.tokens)
                p, p9 = predict(tm, h.dst_deployment, x)
                ana = ph.analytic_transfer(h.src_deployment, h.dst_deployment, h.tokens) + ph.analytic_tbt(
                    h.dst_deployment, h.running, h.kv_tokens, h.tokens, h.max_tokens)
                rows.append((h.t, h.handover_s, p + step, p9 + step, ana, h.tokens,
                             raw_upper(tm, h.dst_deployment, x), step))
        out["handover"] = pack(rows, meta)
    pm = models.terms.get("prefill")
    for term, tier, amount in LOADS:
        tm = models.terms.get(term)
        if tm is None or pm is None:
            continue
        rows, alone = [], []
        for r in load_rows([r for r in ds.prefill if keep(r)], term):
            pre = predict(pm, r.deployment, ph.prefill_x(r.deployment, r.items))[0]
            x = ph.load_x(r.deployment, tier, *amount(r))
            p, p9 = predict(tm, r.deployment, x)
            ana = ph.analytic_load(r.deployment, tier, *amount(r)[:2])
            rows.append((r.t, r.service_s, pre + p, pre + p9, ph.analytic_prefill(r.deployment, r.items) + ana,
                         r.prompt_tokens, raw_upper(tm, r.deployment, x), pre))
            if r.service_s > pre:  # the load alone: the leg minus the learned prefill (its error included)
                alone.append((r.t, r.service_s - pre, p, p9, ana, r.prompt_tokens, raw_upper(tm, r.deployment, x)))
        out[term] = pack(rows)  # the leg: load + prefill, learned and analytic
        out[f"{term}_load"] = pack(alone)
    if ttft and {"prefill", "tbt", "transfer"} <= set(models.terms):
        out["ttft"] = pack(_ttft_rows(models, ph, ds, keep),
                           [(run_of(q.record), q.record.decided_s or 0.0, known_at(q.record), "all")
                            for q in ds.queue if keep(q)])
    return out


def _ttft_rows(models: LearnedModels, ph: Physics, ds: Dataset,
               keep: Callable[[Any], bool]) -> list[tuple[float, ...]]:
    """TTFT = Mooncake queue + prefill + hand-over, each from the learned terms (queue rebuilt from
    the requests ahead as the ledger held them) or from the analytic prior, plus the decode wait
    the decision predicted (the ledger's, recorded: the same for both; on a decode-bound cluster it
    is most of the TTFT, and neither predictor's terms hold it); its upper quantile is the queue,
    the wait and the terms' upper quantiles, times the models' conformal ``ttft_p90_scale``."""
    pm, tm, xm = models.terms["prefill"], models.terms["tbt"], models.terms["transfer"]
    memo_l: dict[str, float] = {}
    memo_a: dict[str, float] = {}

    def learned_prefill(r: Any) -> float:
        v = memo_l.get(r.request_id)
        if v is None:
            dep = r.prefill_deployment or next(iter(ph.d))
            v = memo_l[r.request_id] = predict(pm, dep, ph.prefill_x(dep, [(r.prompt_tokens, r.hit_tokens)]))[0]
        return v

    def analytic_prefill(r: Any) -> float:
        v = memo_a.get(r.request_id)
        if v is None:
            dep = r.prefill_deployment or next(iter(ph.d))
            v = memo_a[r.request_id] = ph.analytic_prefill(dep, [(r.prompt_tokens, r.hit_tokens)])
        return v

    rows: list[tuple[float, ...]] = []
    for q in ds.queue:
        if not keep(q):
            continue
        r = q.record
        src = q.deployment
        dst = r.decode_deployment or src
        mt = r.max_tokens or r.output_tokens
        step_l = predict(tm, dst, ph.tbt_x(dst, r.decode_running, r.decode_kv_tokens, r.prompt_tokens, mt,
                                           r.decode_cluster_running or 0.0, r.decode_kv_share or 1.0))[0]
        kv_l, kv_l9 = predict(xm, dst, ph.transfer_x(src, dst, r.prompt_tokens))
        pre_l, pre_l9 = predict(pm, src, ph.prefill_x(src, [(r.prompt_tokens, r.hit_tokens)]))
        queue_l = reconstructed_queue(q, learned_prefill)
        wait = r.predicted_decode_wait_s or 0.0
        learned = queue_l + pre_l + kv_l + step_l + wait
        learned9 = (queue_l + pre_l9 + kv_l9 + step_l + wait) * models.ttft_p90_scale
        analytic = (reconstructed_queue(q, analytic_prefill) + analytic_prefill(r) + wait
                    + ph.analytic_transfer(src, dst, r.prompt_tokens)
                    + ph.analytic_tbt(dst, r.decode_running, r.decode_kv_tokens, r.prompt_tokens, mt,
                                      r.decode_kv_share or 1.0))
        rows.append((q.t, q.ttft_s, learned, learned9, analytic, r.prompt_tokens))
    return rows


def metrics_of(scored: dict[str, Scored]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for term, s in scored.items():
        out[term] = {"learned": summary(s.learned, s.actual, s.learned_p90), "analytic": summary(s.analytic, s.actual)}
    return out
