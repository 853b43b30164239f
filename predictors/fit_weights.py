"""The regressions behind the learned predictors' terms (predictors/fit.py fits them per term).

A term's point is non-negative least squares on *relative* error (rows weighted by 1/actual^2, as
DistServe does: plain least squares on raw seconds lets the long requests decide everything), or
a relative median; its upper quantile is a linear quantile regression over the same features
(pinball loss relative to the actual, weights non-negative like the point's), with a
split-conformal factor kept as the fallback. Per deployment group when the group has enough rows,
pooled over every group always.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from sklearn.linear_model import LinearRegression  # type: ignore[import-untyped]

from predictors.learned_models import TermModel, TermModels

#: Rows a model needs (per group; the pooled model needs as many in all).
MIN_ROWS = 30
P90 = 0.9


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


#: Rows the quantile model is fitted on at most, a seeded random sample beyond.
QUANTILE_ROWS = 3000
#: Rows the median is fitted on at most, a seeded random sample beyond. Set when the program was
#: solved in its primal form (16,687 TBT rows took 16 s a fit; 4,000 of them gave the same held-out
#: MAPE to 0.01 point, docs/predictors.md); the dual is 25x faster, and the cap stays so that the
#: documented fits do.
MEDIAN_ROWS = 8000


def _sample(n: int, cap: int) -> np.ndarray:
    """All rows, or a seeded random ``cap`` of them (in order)."""
    return np.arange(n) if n <= cap else np.sort(np.random.default_rng(0).choice(n, cap, replace=False))


def pinball_weights(x: np.ndarray, y: np.ndarray, scale: np.ndarray, q: float) -> np.ndarray | None:
    """Non-negative weights of the linear ``q``-quantile: the least pinball loss of y - x @ w, each
    row's loss over ``scale``. The bound w >= 0 is in the linear program itself: clipping an
    unconstrained fit's negative weights is no quantile when features are nearly collinear (the
    TBT's weight read and its spread term, for long decodes, came out as -a and +b, and the clipped
    median was 3.7x the actual). None when the program fails.

    Solved as its dual, max y.d over -(1 - q)/scale <= d <= q/scale with x'd <= 0: one box-bounded
    variable per row and one constraint per feature, where the primal has a constraint per row;
    the weights are the constraints' multipliers. Same optimum, 25x faster at 8,000 rows."""
    inv = 1.0 / np.maximum(scale, 1e-9)
    bounds = np.column_stack([-(1 - q) * inv, q * inv])
    res = linprog(-y, A_ub=x.T, b_ub=np.zeros(x.shape[1]), bounds=bounds, method="highs")
    if res.status != 0:
        return None
    out: np.ndarray = np.maximum(-res.ineqlin.marginals, 0.0)
    return out


def quantile_weights(x: np.ndarray, y: np.ndarray, scale: np.ndarray, q: float) -> tuple[float, ...] | None:
    """The non-negative linear ``q``-quantile of ``y`` over the features, pinball loss relative to
    ``scale`` (so short requests weigh as much as long ones); None when it cannot be fitted."""
    if len(y) < 2 * x.shape[1]:
        return None
    idx = _sample(len(y), QUANTILE_ROWS)
    w = pinball_weights(x[idx], y[idx], scale[idx], q)
    if w is None:
        return None
    # a feature no row has (telemetry from before it was recorded) gets no weight, whatever the solver left
    coef = [float(c) if x[idx, j].any() else 0.0 for j, c in enumerate(w)]
    return tuple(coef) if all(np.isfinite(coef)) else None


def median_weights(x: np.ndarray, y: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Non-negative weights minimising the absolute error relative to y (a relative median): for a
    term whose observations are heavy-tailed (a store load queued behind other transfers on a
    store node's link is 1.5x its roofline at the median, 4.5x at p75, 10x at p90), least squares
    follows the tail; the median follows the typical load. Zeros when the program fails."""
    idx = _sample(len(y), MEDIAN_ROWS)
    w = pinball_weights(x[idx], y[idx] - offset[idx], y[idx], 0.5)
    return np.zeros(x.shape[1]) if w is None else w


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
