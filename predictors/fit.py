"""Fitting the learned predictors' terms (scikit-learn, relative error) and calibrating their p90s.

Each term is fitted on its own observations: lone prefills (a prefill instance found idle), TBT
rows, prefill->decode hand-overs (the first decode step, by the TBT model, as their offset) and
prefix loads from the store or the host tier (the learned prefill as their offset); per
deployment group when the group has enough rows, pooled over every group always (features are
in each row's own physical units, so the pooled weights are inverse efficiencies shared across
hardware). Each upper quantile is then scaled, split- or cross-conformal, to cover its level on
training rows held out of the fit. The regressions are in fit_weights.py, the design matrices in
fit_matrices.py, the scoring in fit_score.py.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

from predictors.dataset import Dataset
from predictors.fit_matrices import (
    LOADS,
    Physics,
    first_step,
    handover_matrix,
    load_matrix,
    load_rows,
    predict,
    prefill_matrix,
    tbt_matrix,
)
from predictors.fit_score import Scored, metrics_of, score
from predictors.fit_weights import MIN_ROWS, P90, fit_term
from predictors.learned_models import LearnedModels, TermModels

# the regressions, the design matrices and the scoring live in fit_weights.py, fit_matrices.py and
# fit_score.py; callers import these from here as before
__all__ = ["MIN_ROWS", "P90", "Scored", "calibration_folds", "conformal_scale", "fit_all", "load_rows", "metrics_of",
           "score"]

#: TBT's point is a relative median (the least absolute percentage error: MAPE is its target and
#: its error is which requests join the batch later, asymmetric), not relative least squares.
TBT_MEDIAN = True


def _servable(m: TermModels | None, term: str, missing: dict[str, str]) -> TermModels | None:
    """``m`` without the models whose point weights are all 0: they predict 0 s, and a model file
    carrying one is refused by every reader. A zero group is left to the pooled model; a zero pool
    leaves the term to the prior, with the reason in ``missing``. (A hand-over whose gaps the
    learned first step already covers fits to 0.)"""
    if m is None:
        return None
    if m.pooled is None or not any(m.pooled.coef):
        missing[term] = (f"its {m.pooled.n if m.pooled else 0} rows fit to all-zero weights "
                         "(the rest of the leg already explains them)")
        return None
    groups = {g: gm for g, gm in m.groups.items() if any(gm.coef)}
    return m if len(groups) == len(m.groups) else TermModels(m.pooled, groups)


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
    elif (m := _servable(m, "prefill", missing)) is not None:
        terms["prefill"] = m
    tb = [r for r in ds.tbt if keep(r.t) and small(r.prompt_tokens)]
    m = fit_term(tbt_matrix(ph, tb), q, min_rows, quantiles=quantiles, median=TBT_MEDIAN) if tb else None
    if m is None:
        missing["tbt"] = f"{len(tb)} TBT rows (need {min_rows}, each with > 8 token gaps)"
    elif (m := _servable(m, "tbt", missing)) is not None:
        terms["tbt"] = m
    ho = [r for r in ds.handover if keep(r.t) and small(r.tokens)]
    if len(ho) >= min_rows:
        partial = LearnedModels(dict(terms))
        f = handover_matrix(ph, ho)
        steps = np.array([first_step(partial, ph, r) for r in ho])
        m = _servable(fit_term(f, q, min_rows, offset=steps, quantiles=quantiles), "transfer", missing)
        if m is not None:
            terms["transfer"] = m
    if "transfer" not in terms and "transfer" not in missing:
        missing["transfer"] = f"{len(ho)} prefill->decode hand-over rows (need {min_rows})"
    # prefix loads: the leg of a lone prefill that loaded first, its learned prefill as the offset
    for term, tier, amount in LOADS:
        rows = load_rows([r for r in ds.prefill if keep(r.t) and small(r.prompt_tokens)], term)
        m = None
        if len(rows) >= min_rows and "prefill" in terms:
            offset = np.array([predict(terms["prefill"], r.deployment, ph.prefill_x(r.deployment, r.items))[0]
                               for r in rows])
            m = _servable(fit_term(load_matrix(ph, rows, term, tier, amount), q, min_rows, offset=offset,
                                   quantiles=quantiles, median=True), term, missing)
        if m is None and term not in missing:
            missing[term] = f"{len(rows)} lone prefills loading a prefix from the {tier} (need {min_rows})"
        elif m is not None:
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
