"""Fitting and scoring the learned predictors' terms (scikit-learn, relative error).

Each term is fitted by non-negative least squares on *relative* error (rows weighted by
1/actual^2, as DistServe does: plain least squares on raw seconds lets the long requests decide
everything). Its upper quantile (p90 by default) is a linear quantile regression over the same
features (pinball loss relative to the actual), with a split-conformal factor (the 0.9 quantile
of actual / predicted on the latest fifth of the training rows, by a model fitted on the rest)
kept as the fallback. Per deployment group when
the group has enough rows, pooled over every group always (features are in each row's own
physical units, so the pooled weights are inverse efficiencies shared across hardware).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np
from sklearn.linear_model import LinearRegression, QuantileRegressor  # type: ignore[import-untyped]

from predictors.analytic import Prior, Roofline, roofline_decode_step_s, roofline_prefill_s
from predictors.dataset import Dataset, HandoverRow, PrefillRow, TBTRow, known_at, reconstructed_queue, run_of
from predictors.facts import Deployment
from predictors.learned_features import (
    FEATURES,
    dot,
    group_of,
    load_features,
    physics,
    prefill_features,
    tbt_features,
    transfer_features,
)
from predictors.learned_models import LearnedModels, TermModel, TermModels
from predictors.types import Tier

#: Rows a model needs (per group; the pooled model needs as many in all).
MIN_ROWS = 30
P90 = 0.9
#: TBT's point is a relative median (the least absolute percentage error: MAPE is its target and
#: its error is which requests join the batch later, asymmetric), not relative least squares.
TBT_MEDIAN = True


@dataclass
class Fitted:
    """A term's training matrix and targets, with the row weights and group labels."""

    x: np.ndarray
    y: np.ndarray
    groups: list[str]
    t: np.ndarray


def fit_weights(x: np.ndarray, y: np.ndarray, offset: np.ndarray | None = None,
                rel: np.ndarray | None = None, rounds: int = 1) -> np.ndarray:
    """Non-negative weights minimising the squared error relative to ``rel`` (default y):
    sum(((x @ w + offset - y) / rel)^2), DistServe's relative-error fit. ``rounds`` > 1 then
    reweights relative to the previous prediction (the mean of a multiplicative noise rather
    than a low-biased fit); measured on the gap profile's telemetry it lowers the hand-over's
    median error but raises every term's MAPE and the TTFT's, so one round is the default."""
    off = np.zeros_like(y) if offset is None else offset
    scale = y if rel is None else rel
    w: np.ndarray = np.zeros(x.shape[1])
    for _ in range(max(1, rounds)):
        reg = LinearRegression(positive=True, fit_intercept=False)
        reg.fit(x, y - off, sample_weight=1.0 / np.maximum(scale, 1e-9) ** 2)
        w = np.maximum(reg.coef_, 0.0)
        pred = x @ w + off
        if not np.all(pred > 0):
            break
        scale = pred
    return w


def conformal_factor(x: np.ndarray, y: np.ndarray, t: np.ndarray, q: float, offset: np.ndarray | None = None) -> float:
    """Split-conformal multiplicative quantile: fit on the earlier 80%, the ``q`` quantile of
    actual / predicted on the latest 20% (at least 1)."""
    n = len(y)
    order = np.argsort(t, kind="stable")
    cut = int(n * 0.8)
    if cut < 2 * x.shape[1] or n - cut < 5:
        return 1.0
    tr, ca = order[:cut], order[cut:]
    off = np.zeros_like(y) if offset is None else offset
    w = fit_weights(x[tr], y[tr], off[tr])
    pred = x[ca] @ w + off[ca]
    ok = pred > 0
    if not ok.any():
        return 1.0
    ratios = y[ca][ok] / pred[ok]
    level = min(1.0, q * (1 + 1.0 / len(ratios)))
    return float(max(1.0, np.quantile(ratios, level)))


#: Rows the quantile model is fitted on at most (a linear program: its time grows with them).
QUANTILE_ROWS = 3000


def quantile_weights(x: np.ndarray, y: np.ndarray, scale: np.ndarray, q: float) -> tuple[float, ...] | None:
    """Linear ``q``-quantile of ``y`` over the features, pinball loss relative to ``scale`` (so
    short requests weigh as much as long ones); None when it cannot be fitted."""
    if len(y) < 2 * x.shape[1]:
        return None
    idx = np.arange(len(y))
    if len(idx) > QUANTILE_ROWS:
        idx = np.random.default_rng(0).choice(idx, QUANTILE_ROWS, replace=False)
    try:
        reg = QuantileRegressor(quantile=q, alpha=0.0, fit_intercept=False, solver="highs")
        reg.fit(x[idx], y[idx], sample_weight=1.0 / np.maximum(scale[idx], 1e-9))
    except ValueError:
        return None
    # a feature no row has (telemetry from before it was recorded) gets no weight, whatever the solver left
    coef = [float(c) if x[idx, j].any() else 0.0 for j, c in enumerate(reg.coef_)]
    return tuple(coef) if all(np.isfinite(coef)) else None


def median_weights(x: np.ndarray, y: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Non-negative weights minimising the absolute error relative to y (a relative median): for a
    term whose observations are heavy-tailed (a store load queued behind other transfers on a
    store node's link is 1.5x its roofline at the median, 4.5x at p75, 10x at p90), least squares
    follows the tail; the median follows the typical load."""
    reg = QuantileRegressor(quantile=0.5, alpha=0.0, fit_intercept=False, solver="highs")
    reg.fit(x, y - offset, sample_weight=1.0 / np.maximum(y, 1e-9))
    out: np.ndarray = np.maximum(reg.coef_, 0.0)
    return out


def fit_term(f: Fitted, q: float = P90, min_rows: int = MIN_ROWS, offset: np.ndarray | None = None,
             rel: np.ndarray | None = None, quantiles: bool = True, median: bool = False) -> TermModels | None:
    """Pooled model plus one per group with enough rows; None when even the pool is too small.
    ``median``: the point is a relative median (:func:`median_weights`), not least squares."""
    if len(f.y) < min_rows:
        return None
    off = np.zeros_like(f.y) if offset is None else offset

    def one(idx: np.ndarray) -> TermModel:
        w = median_weights(f.x[idx], f.y[idx], off[idx]) if median else fit_weights(
            f.x[idx], f.y[idx], off[idx], None if rel is None else rel[idx])
        if not w.any():  # a median of zero (most rows already explained by the offset): least squares
            w = fit_weights(f.x[idx], f.y[idx], off[idx])
        pred = f.x[idx] @ w + off[idx]
        base = f.y[idx] if rel is None else rel[idx]
        mape = float(np.mean(np.abs(pred - f.y[idx]) / np.maximum(base, 1e-12)))
        upper = quantile_weights(f.x[idx], f.y[idx] - off[idx], f.y[idx], q) if quantiles else None
        return TermModel(tuple(float(v) for v in w), conformal_factor(f.x[idx], f.y[idx], f.t[idx], q, off[idx]),
                         int(len(idx)), mape, upper)

    everything = np.arange(len(f.y))
    pooled = one(everything)
    groups: dict[str, TermModel] = {}
    labels = np.array(f.groups)
    for g in sorted(set(f.groups)):
        idx = np.nonzero(labels == g)[0]
        if len(idx) == len(everything):  # one group: it is the pool
            groups[g] = pooled
        elif len(idx) >= min_rows:
            groups[g] = one(idx)
    return TermModels(pooled, groups)


# --- the design matrices ------------------------------------------------------------------------
class Physics:
    """Per-deployment physical units and analytic rooflines, computed once."""

    def __init__(self, deployments: dict[str, Deployment], prior: Prior | None = None):
        prior = Prior() if prior is None else prior
        self.d = deployments
        self.unit: dict[str, Roofline] = {n: physics(d) for n, d in deployments.items()}
        self.prior_roofline = {n: Roofline.from_deployment(d, prior) for n, d in deployments.items()}

    def ts(self, name: str) -> float:
        return self.d[name].time_scale

    def prefill_x(self, dep: str, items: Sequence[tuple[int, int]]) -> list[float]:
        x = [0.0] * len(FEATURES["prefill"])
        for p, c in items:
            for k, v in enumerate(prefill_features(self.unit[dep], self.ts(dep), p, c)):
                x[k] += v
        return x

    def tbt_x(self, dep: str, running: int, kv: int, prompt: int, max_tokens: int,
              cluster: float = 0.0) -> list[float]:
        return tbt_features(self.unit[dep], self.ts(dep), running, kv, prompt, max_tokens, cluster)

    def transfer_x(self, src: str, dst: str, tokens: int) -> list[float]:
        bw = min(self.d[src].net_bytes_per_s, self.d[dst].net_bytes_per_s)
        return transfer_features(self.unit[dst], self.ts(dst), tokens, bw)

    def load_x(self, dep: str, tier: str, tokens: int, loads: int, busy_s: float = 0.0) -> list[float]:
        return load_features(self.unit[dep], self.ts(dep), tier, tokens, loads, busy_s)

    def analytic_load(self, dep: str, tier: str, tokens: int, loads: int) -> float:
        """The prior's load (predictors/analytic.py AnalyticTransfer): latency + bytes / bandwidth."""
        r = self.prior_roofline[dep]
        bw = (r.store_bytes_per_s or r.net_bytes_per_s) if tier == Tier.STORE else r.host_bytes_per_s
        return loads * r.transfer_latency_s + tokens * r.kv_bytes_per_token / bw

    def analytic_prefill(self, dep: str, items: Sequence[tuple[int, int]]) -> float:
        return sum(roofline_prefill_s(self.prior_roofline[dep], p, c) for p, c in items)

    def analytic_tbt(self, dep: str, running: int, kv: int, prompt: int, max_tokens: int) -> float:
        return roofline_decode_step_s(self.prior_roofline[dep], running + 1, kv + prompt + max(1, max_tokens))

    def analytic_transfer(self, src: str, dst: str, tokens: int) -> float:
        s, d = self.prior_roofline[src], self.prior_roofline[dst]
        return max(s.transfer_latency_s, d.transfer_latency_s) + tokens * d.kv_bytes_per_token / min(
            s.net_bytes_per_s, d.net_bytes_per_s)


#: The prefix-load terms: (term, tier, the row's tokens and loads of that tier, and for the store
#: how long its links were predicted busy with write-through at decision).
LOADS: tuple[tuple[str, str, Callable[[PrefillRow], tuple[int, int, float]]], ...] = (
    ("store", Tier.STORE, lambda r: (r.store_tokens, r.store_loads, r.store_busy_s)),
    ("host", Tier.HOST, lambda r: (r.host_tokens, r.host_loads, 0.0)))


def load_rows(rows: Sequence[PrefillRow], term: str) -> list[PrefillRow]:
    """Lone prefills that loaded a prefix of this term's kind only (the store or the host tier)."""
    return [r for r in rows if r.clean and (r.store_loads if term == "store" else r.host_loads)
            and not (r.host_loads if term == "store" else r.store_loads)]


def load_matrix(ph: Physics, rows: Sequence[PrefillRow], term: str, tier: str,
                amount: Callable[[PrefillRow], tuple[int, int, float]]) -> Fitted:
    return Fitted(np.array([ph.load_x(r.deployment, tier, *amount(r)) for r in rows]).reshape(-1, len(FEATURES[term])),
                  np.array([r.service_s for r in rows]), [group_of(r.deployment) for r in rows],
                  np.array([r.t for r in rows]))


def prefill_matrix(ph: Physics, rows: Sequence[PrefillRow]) -> Fitted:
    return Fitted(np.array([ph.prefill_x(r.deployment, r.items) for r in rows]).reshape(-1, len(FEATURES["prefill"])),
                  np.array([r.service_s for r in rows]), [group_of(r.deployment) for r in rows],
                  np.array([r.t for r in rows]))


def tbt_matrix(ph: Physics, rows: Sequence[TBTRow]) -> Fitted:
    return Fitted(np.array([ph.tbt_x(r.deployment, r.running, r.kv_tokens, r.prompt_tokens, r.max_tokens,
                                     r.cluster_running) for r in rows]).reshape(-1, len(FEATURES["tbt"])),
                  np.array([r.tbt_s for r in rows]), [group_of(r.deployment) for r in rows],
                  np.array([r.t for r in rows]))


def handover_matrix(ph: Physics, rows: Sequence[HandoverRow]) -> Fitted:
    return Fitted(np.array([ph.transfer_x(r.src_deployment, r.dst_deployment, r.tokens)
                            for r in rows]).reshape(-1, len(FEATURES["transfer"])),
                  np.array([r.handover_s for r in rows]), [group_of(r.dst_deployment) for r in rows],
                  np.array([r.t for r in rows]))


def predict(models: TermModels, group: str, x: Sequence[float]) -> tuple[float, float]:
    """(point, p90) from the group's model or the pooled one."""
    m, _ = models.for_group(group_of(group))
    assert m is not None
    return dot(m.coef, x), m.upper(x)


def raw_upper(models: TermModels, group: str, x: Sequence[float]) -> float:
    m, _ = models.for_group(group_of(group))
    assert m is not None
    return m.raw_upper(x)


def first_step(models: LearnedModels, ph: Physics, r: HandoverRow) -> float:
    tm = models.terms.get("tbt")
    if tm is None:
        return ph.analytic_tbt(r.dst_deployment, r.running, r.kv_tokens, r.tokens, r.max_tokens)
    return predict(tm, r.dst_deployment, ph.tbt_x(r.dst_deployment, r.running, r.kv_tokens, r.tokens, r.max_tokens,
                                                  r.cluster_running))[0]


def _fit_terms(ds: Dataset, keep: Callable[[float], bool], q: float, max_prompt: int | None, min_rows: int,
               quantiles: bool) -> tuple[LearnedModels, dict[str, str]]:
    ph = Physics(ds.deployments)
    terms: dict[str, TermModels] = {}
    missing: dict[str, str] = {}

    def small(p: int) -> bool:
        return max_prompt is None or p <= max_prompt

    pre = [r for r in ds.prefill if keep(r.t) and small(r.prompt_tokens) and not r.loads]
    clean = [r for r in pre if r.clean]
    if len(clean) >= min_rows:  # lone prefills are exact observations; shared steps blur the rest
        pre = clean
    m = fit_term(prefill_matrix(ph, pre), q, min_rows, quantiles=quantiles) if pre else None
    if m is None:
        missing["prefill"] = f"{len(pre)} prefill rows (need {min_rows})"
    else:
        terms["prefill"] = m
    tb = [r for r in ds.tbt if keep(r.t) and small(r.prompt_tokens)]
    m = fit_term(tbt_matrix(ph, tb), q, min_rows, quantiles=quantiles, median=TBT_MEDIAN) if tb else None
    if m is None:
        missing["tbt"] = f"{len(tb)} TBT rows (need {min_rows}, each with > 8 token gaps)"
    else:
        terms["tbt"] = m
    ho = [r for r in ds.handover if keep(r.t) and small(r.tokens)]
    if len(ho) >= min_rows:
        partial = LearnedModels(dict(terms))
        f = handover_matrix(ph, ho)
        steps = np.array([first_step(partial, ph, r) for r in ho])
        m = fit_term(f, q, min_rows, offset=steps, quantiles=quantiles)
        if m is not None:
            terms["transfer"] = m
    if "transfer" not in terms:
        missing["transfer"] = f"{len(ho)} prefill->decode hand-over rows (need {min_rows})"
    # prefix loads: the leg of a lone prefill that loaded first, its learned prefill as the offset
    for term, tier, amount in LOADS:
        rows = load_rows([r for r in ds.prefill if keep(r.t) and small(r.prompt_tokens)], term)
        m = None
        if len(rows) >= min_rows and "prefill" in terms:
            offset = np.array([predict(terms["prefill"], r.deployment, ph.prefill_x(r.deployment, r.items))[0]
                               for r in rows])
            m = fit_term(load_matrix(ph, rows, term, tier, amount), q, min_rows, offset=offset, quantiles=quantiles,
                         median=True)
        if m is None:
            missing[term] = f"{len(rows)} lone prefills loading a prefix from the {tier} (need {min_rows})"
        else:
            terms[term] = m
    return LearnedModels(terms), missing


#: Calibration rows a conformal scale needs (fewer: the fitted quantile is served unscaled).
MIN_CALIBRATION_ROWS = 10


def conformal_scale(actual: np.ndarray, point: np.ndarray, upper: np.ndarray, q: float,
                    offset: np.ndarray | None = None) -> float | None:
    """Split-conformal scale s of an upper quantile: the smallest s with ``actual <= offset +
    max(point, s x upper)`` on a share ``q`` of the calibration rows (the ceil((n+1)q)-th score,
    the finite-sample correction); None with too few rows. Below 1 when the fitted quantile
    over-covers, above when it under-covers (e.g. the calibration rows are later, busier ones)."""
    off = np.zeros_like(actual) if offset is None else offset
    ok = upper > 0
    a, p, u, o = actual[ok], point[ok], upper[ok], off[ok]
    n = len(a)
    if n < MIN_CALIBRATION_ROWS:
        return None
    scores = np.where(a - o <= p, -np.inf, (a - o) / u)
    k = min(n, int(np.ceil((n + 1) * q)))
    s = float(np.sort(scores)[k - 1])
    return float(min(50.0, max(0.01, s))) if np.isfinite(s) else 0.01


def _scaled(tm: TermModels, scale: float) -> TermModels:
    return TermModels(None if tm.pooled is None else replace(tm.pooled, p90_scale=scale),
                      {g: replace(m, p90_scale=scale) for g, m in tm.groups.items()})


def calibrate_quantiles(folds: Sequence[tuple[LearnedModels, Callable[[Any], bool]]], ds: Dataset, q: float
                        ) -> dict[str, Any]:
    """Each term's conformal scale (and the TTFT's) from the calibration rows of every fold: a
    fold is models and the rows ``cal(row)`` selects, which those models were not fitted on. The
    scores of all folds are pooled (one fold: split conformal; K folds: cross-conformal, every
    training row calibrates once). Returns, per term, the scale (None: too few rows) and n."""
    key = {"prefill": "prefill", "tbt": "tbt", "transfer": "handover", "store": "store", "host": "host"}
    pooled: dict[str, list[Scored]] = {}
    for models, cal in folds:
        for term, s_ in score(models, ds, cal, ttft=False).items():
            pooled.setdefault(term, []).append(s_)

    def cat(parts: list[Scored], field: str) -> np.ndarray:
        return np.concatenate([getattr(p, field) for p in parts]) if parts else np.zeros(0)

    info: dict[str, Any] = {}
    terms = {t for m, _ in folds for t in m.terms}
    for term in sorted(terms):
        parts = pooled.get(key[term], [])
        actual, offset = cat(parts, "actual"), cat(parts, "offset")
        # score() gives the handover as step + shipment: the offset is the step, the point is the rest
        scale = conformal_scale(actual, cat(parts, "learned") - offset, cat(parts, "learned_p90_raw"), q, offset)
        info[term] = {"scale": scale, "n": int(len(actual))}
    if all(t in terms for t in ("prefill", "tbt", "transfer")):
        parts = []
        for models, cal in folds:
            scaled = LearnedModels({t: _scaled(tm, info[t]["scale"]) if info.get(t, {}).get("scale") else tm
                                    for t, tm in models.terms.items()}, models.meta)
            rows = score(scaled, ds, cal).get("ttft")
            if rows is not None:
                parts.append(rows)
        actual = cat(parts, "actual")
        s = conformal_scale(actual, np.zeros_like(actual), cat(parts, "learned_p90"), q)
        info["ttft"] = {"scale": s, "n": int(len(actual))}
    return info


def calibration_folds(ds: Dataset, train: Callable[[float], bool], how: str, fraction: float = 0.2,
                      seed: int = 0) -> list[tuple[Callable[[float], bool], Callable[[Any], bool]]]:
    """(proper(t), cal(row)) pairs within the training rows: ``time``, the latest ``fraction`` of
    them; ``random``, a random share; ``cv``, round(1 / fraction) folds of random positions, each
    calibrating the models fitted on the others (cross-conformal: lower variance than one split,
    which matters when the upper quantile sits close to the point); ``blocked`` and ``forward``,
    the same over contiguous stretches of time (:func:`_time_blocks`)."""
    ts = sorted({r.t for r in ds.prefill} | {r.t for r in ds.tbt} | {r.t for r in ds.queue})
    ts = [t for t in ts if train(t)]
    if not ts:
        return []
    if how == "time":
        cut = ts[min(len(ts) - 1, int(len(ts) * (1 - fraction)))]
        return [((lambda t: train(t) and t < cut), (lambda row: train(row.t) and row.t >= cut))]
    if how in ("blocked", "forward"):
        return _time_blocks(ts, train, max(2, round(1 / fraction)), how == "forward")
    rng = np.random.default_rng(seed + 1)
    k = max(2, round(1 / fraction)) if how == "cv" else 1
    fold_of = {t: int(f) for t, f in zip(ts, rng.integers(0, k, len(ts)) if how == "cv" else
                                         np.where(rng.random(len(ts)) < fraction, 0, -1), strict=True)}

    def pair(f: int) -> tuple[Callable[[float], bool], Callable[[Any], bool]]:
        return (lambda t: train(t) and fold_of.get(t) != f), (lambda row: fold_of.get(row.t) == f)

    return [pair(f) for f in range(k)]


def _time_blocks(ts: Sequence[float], train: Callable[[float], bool], k: int, forward: bool
                 ) -> list[tuple[Callable[[float], bool], Callable[[Any], bool]]]:
    """``k`` contiguous blocks of the training positions, in time order: ``blocked``, each block
    calibrates the models fitted on all the others (cross-conformal whose folds keep the drift
    within a run, as a time hold-out has it); ``forward``, each block but the first calibrates
    the models fitted on the blocks before it only (every score is a prediction of the future)."""
    edges = [ts[min(len(ts) - 1, (len(ts) * i) // k)] for i in range(k)] + [float("inf")]

    def pair(i: int) -> tuple[Callable[[float], bool], Callable[[Any], bool]]:
        lo, hi = edges[i], edges[i + 1]
        proper = ((lambda t: train(t) and t < lo) if forward else (lambda t: train(t) and not lo <= t < hi))
        return proper, (lambda row: train(row.t) and lo <= row.t < hi)

    return [pair(i) for i in range(1 if forward else 0, k)]


def fit_all(ds: Dataset, train: Callable[[float], bool] | None = None, q: float = P90,
            max_prompt: int | None = None, min_rows: int = MIN_ROWS,
            quantiles: bool = True, calibration: str | None = "cv", cal_fraction: float = 0.2,
            seed: int = 0) -> tuple[LearnedModels, dict[str, str]]:
    """Fit every term on the rows ``train(t)`` keeps (and, for extrapolation checks, only prompts
    up to ``max_prompt``); returns the models and, per term left out, why. ``quantiles`` False
    skips the quantile regressions (a point-only fit). ``calibration`` (``cv``, ``blocked``,
    ``forward``, ``time`` or ``random``; None: none) holds out training rows (see
    :func:`calibration_folds`), fits on the rest, scales each upper quantile so that it covers
    ``q`` of the held-out rows (conformal), and serves the models fitted on every training row
    with those scales (``meta["p90_calibration"]``)."""
    keep = train or (lambda t: True)
    models, missing = _fit_terms(ds, keep, q, max_prompt, min_rows, quantiles)
    if not quantiles or calibration is None or not models.terms:
        return models, missing
    folds = [(_fit_terms(ds, proper, q, max_prompt, min_rows, quantiles)[0], cal)
             for proper, cal in calibration_folds(ds, keep, calibration, cal_fraction, seed)]
    info = calibrate_quantiles(folds, ds, q)
    terms = {t: _scaled(tm, info[t]["scale"]) if info.get(t, {}).get("scale") is not None else tm
             for t, tm in models.terms.items()}
    ttft = (info.get("ttft") or {}).get("scale")
    return LearnedModels(terms, {**models.meta, "p90_calibration": {"split": calibration, **info}},
                         1.0 if ttft is None else ttft), missing


# --- scoring --------------------------------------------------------------------------------
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
                x = ph.tbt_x(b.deployment, b.running, b.kv_tokens, b.prompt_tokens, b.max_tokens, b.cluster_running)
                p, p9 = predict(tm, b.deployment, x)
                rows.append((b.t, b.tbt_s, p, p9, ph.analytic_tbt(b.deployment, b.running, b.kv_tokens,
                                                                  b.prompt_tokens, b.max_tokens), b.prompt_tokens,
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
    the requests ahead as the ledger held them) or from the analytic prior; its upper quantile is
    the queue plus the terms' upper quantiles, times the models' conformal ``ttft_p90_scale``."""
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
                                           r.decode_cluster_running or 0.0))[0]
        kv_l, kv_l9 = predict(xm, dst, ph.transfer_x(src, dst, r.prompt_tokens))
        pre_l, pre_l9 = predict(pm, src, ph.prefill_x(src, [(r.prompt_tokens, r.hit_tokens)]))
        queue_l = reconstructed_queue(q, learned_prefill)
        learned = queue_l + pre_l + kv_l + step_l
        learned9 = (queue_l + pre_l9 + kv_l9 + step_l) * models.ttft_p90_scale
        analytic = (reconstructed_queue(q, analytic_prefill) + analytic_prefill(r)
                    + ph.analytic_transfer(src, dst, r.prompt_tokens)
                    + ph.analytic_tbt(dst, r.decode_running, r.decode_kv_tokens, r.prompt_tokens, mt))
        rows.append((q.t, q.ttft_s, learned, learned9, analytic, r.prompt_tokens))
    return rows


def metrics_of(scored: dict[str, Scored]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for term, s in scored.items():
        out[term] = {"learned": summary(s.learned, s.actual, s.learned_p90), "analytic": summary(s.analytic, s.actual)}
    return out
