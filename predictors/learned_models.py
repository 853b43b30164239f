"""The learned predictors' model file (``models.json``): its fitted terms, and their validation.

Plain JSON, never pickle. A file is validated whole before it is served (:func:`load_models`,
:class:`ModelError` with the reason otherwise), so a reload never half-swaps; files fitted on an
earlier, shorter feature list of a term are served with the newer weights at 0.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from predictors.learned_features import FEATURES, LEGACY_FEATURES, TERMS, dot

FORMAT = "conductor-learned-predictors"
VERSION = 1
MODELS_FILE = "models.json"


#: ``meta`` key: the TBT rows recorded their decode instance's KV share (telemetry since
#: 2026-12-03), so the fit read a full cache at it; a file without it was fitted as if every
#: share were 1, and its TBT is served so (the live share would count the sharing twice).
TBT_KV_SHARE = "tbt_kv_share"


class ModelError(ValueError):
    """A model file that cannot be served (one-line message naming what is wrong)."""


@dataclass(frozen=True)
class TermModel:
    """One fitted term: weights over the term's features, and its upper quantile (p90 by default):
    a linear quantile model over the same features (``p90_coef``), else a factor over the point,
    times ``p90_scale``, the split-conformal adjustment that made the quantile cover its level on
    a calibration split the model was not fitted on (predictors/fit.py ``conformal_scale``)."""

    coef: tuple[float, ...]
    p90_factor: float = 1.0
    n: int = 0
    train_mape: float | None = None
    p90_coef: tuple[float, ...] | None = None
    p90_scale: float = 1.0

    def predict(self, x: Sequence[float]) -> float:
        return dot(self.coef, x)

    def upper(self, x: Sequence[float]) -> float:
        """The upper quantile, never below the point prediction."""
        return max(dot(self.coef, x), self.p90_scale * self.raw_upper(x))

    def raw_upper(self, x: Sequence[float]) -> float:
        """The fitted quantile before the conformal scale."""
        if self.p90_coef is None:
            return dot(self.coef, x) * self.p90_factor
        return dot(self.p90_coef, x)

    def to_json(self) -> dict[str, Any]:
        return {"coef": list(self.coef), "p90_factor": self.p90_factor, "n": self.n, "train_mape": self.train_mape,
                "p90_coef": None if self.p90_coef is None else list(self.p90_coef), "p90_scale": self.p90_scale}


@dataclass(frozen=True)
class TermModels:
    """A term's pooled model and its per-deployment-group models."""

    pooled: TermModel | None
    groups: dict[str, TermModel] = field(default_factory=dict)

    def for_group(self, group: str) -> tuple[TermModel | None, str]:
        m = self.groups.get(group)
        if m is not None:
            return m, f"group:{group}"
        return self.pooled, "pooled"


@dataclass(frozen=True)
class LearnedModels:
    """Every term's models; ``ttft_p90_scale`` scales the sum of the terms' upper quantiles (and the
    queue's point) to the TTFT's own upper quantile, split-conformal like each term's ``p90_scale``."""

    terms: dict[str, TermModels]
    meta: dict[str, Any] = field(default_factory=dict)
    ttft_p90_scale: float = 1.0

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "meta": self.meta,
                "calibration": {"ttft_p90_scale": self.ttft_p90_scale},
                "terms": {t: {"features": list(FEATURES[t]),
                              "pooled": None if m.pooled is None else m.pooled.to_json(),
                              "groups": {g: gm.to_json() for g, gm in m.groups.items()}}
                          for t, m in self.terms.items()}}

    def save(self, directory: str) -> str:
        """Write ``models.json`` atomically (a reader never sees half a file)."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, MODELS_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)
        return path


def _term_model(raw: Any, n_features: int, where: str) -> TermModel:
    if not isinstance(raw, dict):
        raise ModelError(f"{where}: expected an object")
    coef = raw.get("coef")
    if not isinstance(coef, list) or len(coef) != n_features:
        raise ModelError(f"{where}: coef must be a list of {n_features} numbers")
    for c in coef:
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ModelError(f"{where}: coefficients must be finite and >= 0, got {c!r}")
    if not any(coef):
        raise ModelError(f"{where}: all coefficients are zero")
    p90 = _positive(raw.get("p90_factor", 1.0), f"{where}: p90_factor")
    scale = _positive(raw.get("p90_scale", 1.0), f"{where}: p90_scale")
    n = raw.get("n", 0)
    mape = raw.get("train_mape")
    q = raw.get("p90_coef")
    if q is not None:
        if not isinstance(q, list) or len(q) != n_features or any(
                isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) for c in q):
            raise ModelError(f"{where}: p90_coef must be a list of {n_features} finite numbers")
    return TermModel(tuple(float(c) for c in coef), p90, int(n) if isinstance(n, int) else 0,
                     float(mape) if isinstance(mape, (int, float)) and not isinstance(mape, bool) else None,
                     None if q is None else tuple(float(c) for c in q), scale)


def _positive(v: Any, where: str) -> float:
    """A quantile factor or scale: positive, finite, below 100 (files from before it say nothing: 1)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v < 100:
        raise ModelError(f"{where} must be a positive finite number, got {v!r}")
    return float(v)


def parse_models(raw: Any) -> LearnedModels:
    """Validate a decoded ``models.json``; :class:`ModelError` on anything that cannot be served."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ModelError(f"not a {FORMAT} file")
    if raw.get("version") != VERSION:
        raise ModelError(f"unsupported version {raw.get('version')!r} (this gateway reads {VERSION})")
    terms_raw = raw.get("terms")
    if not isinstance(terms_raw, dict):
        raise ModelError("terms: expected an object")
    unknown = set(terms_raw) - set(TERMS)
    if unknown:
        raise ModelError(f"terms: unknown term(s) {', '.join(sorted(unknown))}; known: {', '.join(TERMS)}")
    terms: dict[str, TermModels] = {}
    for t, tr in terms_raw.items():
        if not isinstance(tr, dict):
            raise ModelError(f"terms.{t}: expected an object")
        n = len(FEATURES[t])
        legacy = LEGACY_FEATURES.get(t)
        if legacy is not None and tr.get("features") == list(legacy):  # fitted before the last ones
            tr = _padded(tr, len(legacy), FEATURES[t])
        if tr.get("features") != list(FEATURES[t]):
            raise ModelError(f"terms.{t}: features {tr.get('features')!r} are not this gateway's "
                             f"{list(FEATURES[t])} (recalibrate)")
        pooled = None if tr.get("pooled") is None else _term_model(tr["pooled"], n, f"terms.{t}.pooled")
        groups_raw = tr.get("groups") or {}
        if not isinstance(groups_raw, dict):
            raise ModelError(f"terms.{t}.groups: expected an object")
        groups = {str(g): _term_model(m, n, f"terms.{t}.groups.{g}") for g, m in groups_raw.items()}
        if pooled is None and not groups:
            raise ModelError(f"terms.{t}: no model")
        terms[t] = TermModels(pooled, groups)
    meta = raw.get("meta")
    cal = raw.get("calibration") or {}
    if not isinstance(cal, dict):
        raise ModelError("calibration: expected an object")
    return LearnedModels(terms, meta if isinstance(meta, dict) else {},
                         _positive(cal.get("ttft_p90_scale", 1.0), "calibration.ttft_p90_scale"))


def _padded(tr: dict[str, Any], have: int, features: tuple[str, ...]) -> dict[str, Any]:
    """A term fitted on the first ``have`` of today's ``features``: the rest weigh 0 (lists of the
    wrong length are left as they are, for :func:`_term_model` to refuse)."""
    n = len(features)
    def pad(m: Any) -> Any:
        if not isinstance(m, dict):
            return m
        out = dict(m)
        for k in ("coef", "p90_coef"):
            if isinstance(out.get(k), list) and len(out[k]) == have:
                out[k] = out[k] + [0.0] * (n - have)
        return out
    groups = tr.get("groups")
    return {**tr, "features": list(features), "pooled": pad(tr.get("pooled")),
            "groups": {g: pad(m) for g, m in groups.items()} if isinstance(groups, dict) else groups}


def load_models(directory: str) -> LearnedModels:
    """Read and validate ``DIR/models.json``; :class:`ModelError` with the reason otherwise."""
    path = os.path.join(directory, MODELS_FILE)
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file (run conductor calibrate --out {directory})") from None
    except OSError as e:
        raise ModelError(f"{path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    try:
        return parse_models(raw)
    except ModelError as e:
        raise ModelError(f"{path}: {e}") from None
