"""Learned predictors: the roofline's own terms as features, weights fitted to telemetry.

Each term is a non-negative linear combination of physical quantities computed from an
instance's public :class:`~predictors.facts.Deployment` at 100% efficiency (seconds of linear
compute, of attention, of weight and KV reads, of bytes over the NIC). A weight is then an
inverse efficiency (or a fixed cost in units of the hardware's own time), so a model fitted on
short prompts still scales like the physics on long ones, and one fitted on one deployment means
something on another (the pooled model). No two features are proportional on one deployment, so
the weights are identifiable. ``conductor calibrate`` (predictors/calibrate.py) fits them; this
module loads, validates and serves them.

Serving is closed form: a dot product of a few numbers, memoised per (deployment, inputs), as
cheap as the analytic roofline. Per term, an instance's deployment group model answers, else the
pooled model, else the analytic predictor (logged once). An online EWMA of
actual / predicted absorbs drift between calibrations, each term corrected only from
observations *of that term* (prefill from requests that found their prefill instance idle, TBT
from the request's own token gaps, the prefill->decode KV shipment from the hand-over gap);
prefill per instance, TBT and shipment per deployment group (:meth:`LearnedBundle.correction_key`).
With it, each term's calibrated p90 is tracked online per deployment group (adaptive conformal:
predictors/online_quantile.py), so its coverage stays at 90% through drift (:meth:`LearnedBundle.p90`).

Model files are plain JSON (``models.json``): no pickle is ever loaded.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from statistics import NormalDist
from typing import Any, Callable, Hashable, Sequence

from predictors.analytic import AnalyticQueue, AnalyticTBT, AnalyticTransfer, DeploymentBook, Prior, Roofline
from predictors.base import DecodeState, Predictors
from predictors.facts import TIME_SCALE_SEP, Deployment
from predictors.online_quantile import DEFAULT_ETA, QuantileTracker
from predictors.store_traffic import StoreTraffic
from predictors.telemetry import RequestRecord
from predictors.types import Tier

log = logging.getLogger(__name__)

FORMAT = "conductor-learned-predictors"
VERSION = 1
MODELS_FILE = "models.json"
#: Context scale of the second-order attention feature (keeps its weight near 1).
CTX_SCALE = 65536.0
#: Token budget per engine step the prefill features assume (vLLM's default for large models).
CHUNK_TOKENS = 8192

PREFILL_FEATURES = ("step_s", "linear_s", "attn_s", "attn_ctx_s")
TBT_FEATURES = ("step_s", "kv_read_s", "batch_s", "spread_s", "cluster_s")
#: The TBT features before ``spread_s`` and ``cluster_s``: a file with them is served with those
#: two weights at 0 (what it was fitted as).
TBT_FEATURES_V1 = TBT_FEATURES[:3]
TRANSFER_FEATURES = ("latency_s", "bytes_s")
#: A store load also waits for the store's links: the part of the write-through they are busy with
#: (predictors/store_traffic.py ``busy_s``) beyond the load's own transfer.
STORE_FEATURES = TRANSFER_FEATURES + ("write_wait_s",)
#: ``store`` and ``host``: loading a prefix from the shared store / the host tier before the prefill
#: (a fixed cost per load, and the bytes over the store's public bandwidth / the host link's).
FEATURES: dict[str, tuple[str, ...]] = {"prefill": PREFILL_FEATURES, "tbt": TBT_FEATURES, "transfer": TRANSFER_FEATURES,
                                        "store": STORE_FEATURES, "host": TRANSFER_FEATURES}
#: Feature lists of earlier model files still served: their weights padded with zeros.
LEGACY_FEATURES: dict[str, tuple[str, ...]] = {"store": TRANSFER_FEATURES, "tbt": TBT_FEATURES_V1}
TERMS = tuple(FEATURES)

#: A roofline at 100% efficiency and no fixed costs: the features' units.
_UNIT = Prior(prefill_mfu=1.0, attn_mfu=1.0, decode_mbu=1.0, step_overhead_ms=0.0, transfer_latency_ms=0.0)


def physics(d: Deployment) -> Roofline:
    return Roofline.from_deployment(d, _UNIT)


def prefill_features(r: Roofline, time_scale: float, prompt_tokens: int, cached_tokens: int) -> list[float]:
    """Chunked prefill of the uncached tokens, at peak rates: a weight read per step (what each
    step costs whatever its size: overhead, launch, weights), linear FLOPs, causal attention
    FLOPs, and attention FLOPs weighted by context (second order: kernels slowing with it)."""
    prompt = max(1, prompt_tokens)
    cached = min(max(0, cached_tokens), prompt - 1)
    new = prompt - cached
    steps = math.ceil(new / CHUNK_TOKENS)
    attn = 4.0 * r.layers * r.hidden / r.attn_flops_per_s
    sum_ctx = new * (cached + (new + 1) / 2.0)  # contexts cached+1 .. prompt
    sum_ctx2 = (prompt * (prompt + 1) * (2 * prompt + 1) - cached * (cached + 1) * (2 * cached + 1)) / 6.0
    return [steps * r.weight_bytes / r.mem_bytes_per_s, 2.0 * r.params * new / r.flops_per_s, attn * sum_ctx,
            attn * sum_ctx2 / CTX_SCALE]


#: Gaps beyond which the slowest-10% statistic no longer changes (the limit is 1.755).
SPREAD_GAPS = 1000


@lru_cache(maxsize=4096)
def slowest_share(gaps: int) -> float:
    """Mooncake's TBT is the mean of a request's slowest 10% of ``gaps`` token gaps: in units of
    the gaps' spread, the expected mean of the top ceil(gaps/10) of ``gaps`` standard normal draws
    (Blom's plotting positions), 0 for one gap, rising to 1.755 (a statistical fact, no engine's)."""
    n = min(SPREAD_GAPS, max(1, gaps))
    k = max(1, math.ceil(0.1 * n))
    inv = NormalDist().inv_cdf
    return math.fsum(inv((i - 0.375) / (n + 0.25)) for i in range(n - k + 1, n + 1)) / k


def tbt_features(r: Roofline, time_scale: float, running: int, kv_tokens: int, prompt_tokens: int,
                 max_tokens: int, cluster_running: float = 0.0) -> list[float]:
    """A decode step once this request joins, at peak rates: the weight read (what every step
    costs: overhead, launch, weights), the KV read (at the request's largest, as the analytic
    TBT) and the batch's linear FLOPs (what each sequence adds: FLOPs, sampling, bookkeeping);
    then what decides the slowest 10% of its gaps: the weight read times :func:`slowest_share` of
    its gaps (a longer decode sees more of the step's spread and of the batch's swings), and the
    per-sequence FLOPs times the cluster's decode load (reservations per decode instance, which
    the scheduler spreads over the instances: the batch this one drifts to after placement)."""
    batch = max(0, running) + 1
    kv = max(0, kv_tokens) + max(0, prompt_tokens) + max(1, max_tokens)
    weights, per_seq = r.weight_bytes / r.mem_bytes_per_s, 2.0 * r.params / r.flops_per_s
    return [weights, kv * r.kv_bytes_per_token / r.mem_bytes_per_s, per_seq * batch,
            weights * slowest_share(max(1, max_tokens) - 1), per_seq * max(0.0, cluster_running)]


def transfer_features(r_dst: Roofline, time_scale: float, tokens: int, bandwidth: float) -> list[float]:
    return [time_scale, tokens * r_dst.kv_bytes_per_token / bandwidth]


def load_features(r: Roofline, time_scale: float, tier: str, tokens: int, loads: int = 1,
                  busy_s: float = 0.0) -> list[float]:
    """Loading ``tokens`` of prefix KV (in ``loads`` operations) onto the prefill instance from the
    shared store (at the prior's public store bandwidth, never above the NIC) or its host tier
    (at the deployment's host link): the roofline's own transfer, as a load term's features. A
    store load adds the wait for the store's links: ``busy_s`` (how long they stay busy with
    write-through, as the gateway predicts it) beyond the load's own transfer (a load and the
    puts ahead of it share the link: it ends at the later of the two)."""
    bw = r.store_bytes_per_s or r.net_bytes_per_s if tier == Tier.STORE else r.host_bytes_per_s
    own = tokens * r.kv_bytes_per_token / bw
    if tier != Tier.STORE:
        return [loads * time_scale, own]
    return [loads * time_scale, own, busy_s - own if busy_s > own else 0.0]


def group_of(deployment: str) -> str:
    """The model group of a deployment: its name without any time scale (features carry that)."""
    return deployment.split(TIME_SCALE_SEP, 1)[0]


def dot(w: Sequence[float], x: Sequence[float]) -> float:
    return math.fsum(a * b for a, b in zip(w, x, strict=True))


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


class Ewma:
    """Per-key EWMA of actual / predicted, bounded, and the live error it has seen."""

    __slots__ = ("alpha", "lo", "hi", "factor", "count", "abs_err")

    def __init__(self, alpha: float = 0.05, lo: float = 0.5, hi: float = 2.0):
        self.alpha, self.lo, self.hi = alpha, lo, hi
        self.factor: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.abs_err: dict[str, float] = {}

    def get(self, key: str) -> float:
        return self.factor.get(key, 1.0)

    def update(self, key: str, actual: float, base: float, served: float | None, correct: bool = True) -> None:
        """``base``: the model's answer without correction; ``served``: what was predicted then;
        ``correct`` False only tracks the live error (the factor stays)."""
        if not (actual > 0 and base > 0 and math.isfinite(actual) and math.isfinite(base)):
            return
        if correct:
            ratio = min(self.hi, max(self.lo, actual / base))
            f = self.factor.get(key, 1.0)
            self.factor[key] = min(self.hi, max(self.lo, f + self.alpha * (ratio - f)))
        self.count[key] = self.count.get(key, 0) + 1
        if served is not None and served > 0:
            e = abs(served / actual - 1.0)
            prev = self.abs_err.get(key)
            self.abs_err[key] = e if prev is None else prev + self.alpha * (e - prev)


#: Observations a TBT needs: a request's Mooncake TBT over fewer gaps is mostly noise.
MIN_TBT_INTERVALS = 8
#: Quantities whose p90 is tracked online (as ``conductor calibrate`` scores them: the hand-over is
#: the shipment's p90 plus the first step) and the term each one's status is shown under.
QUANTILE_TERMS = ("prefill", "tbt", "handover", "ttft")
_TRACKED_AS = {"prefill": "prefill", "tbt": "tbt", "transfer": "handover"}


@dataclass(frozen=True, slots=True)
class _Compiled:
    """One instance's terms in closed form: each model's weights folded into its deployment's
    physical constants, so a prediction is a handful of multiplications (no feature vector)."""

    key: int  # the book's roofline key (memo key)
    group: str
    group_key: str  # the online correction's key for TBT and the shipment
    net_bytes_per_s: float
    prefill: tuple[float, float, float, float] | None  # per step, per new token, per context, per context^2
    tbt: tuple[float, float, float, float, float] | None  # per step, KV token, sequence, slowest share, cluster load
    transfer: tuple[float, float] | None  # latency, bytes per token (over the bandwidth)
    store: tuple[float, float, float, float] | None  # latency, s per token (fitted, at peak), per s of link wait
    host: tuple[float, float] | None  # latency, seconds per token loaded from the host tier


def _compile(models: LearnedModels, key: int, r: Roofline, ts: float, group: str, served: Roofline) -> _Compiled:
    def model(term: str) -> TermModel | None:
        tm = models.terms.get(term)
        return None if tm is None else tm.for_group(group)[0]

    attn = 4.0 * r.layers * r.hidden / r.attn_flops_per_s
    weights = r.weight_bytes / r.mem_bytes_per_s
    p, t, x = model("prefill"), model("tbt"), model("transfer")

    def load(term: str, tier: str) -> tuple[float, float] | None:
        m = model(term)
        if m is None:
            return None
        lat, per_token = load_features(r, ts, tier, 1)[:2]
        return m.coef[0] * lat, m.coef[1] * per_token

    def store() -> tuple[float, float, float, float] | None:
        m, lp = model("store"), load("store", Tier.STORE)
        if m is None or lp is None:
            return None
        return lp[0], lp[1], load_features(r, ts, Tier.STORE, 1)[1], m.coef[2]
    return _Compiled(
        key, group, f"group:{group}", served.net_bytes_per_s,
        None if p is None else (p.coef[0] * weights, p.coef[1] * 2.0 * r.params / r.flops_per_s, p.coef[2] * attn,
                                p.coef[3] * attn / CTX_SCALE),
        None if t is None else (t.coef[0] * weights, t.coef[1] * r.kv_bytes_per_token / r.mem_bytes_per_s,
                                t.coef[2] * 2.0 * r.params / r.flops_per_s, t.coef[3] * weights,
                                t.coef[4] * 2.0 * r.params / r.flops_per_s),
        None if x is None else (x.coef[0] * ts, x.coef[1] * r.kv_bytes_per_token),
        store(), load("host", Tier.HOST))


#: Resolution of the served prefill correction (0.5%): see :meth:`LearnedBundle.group`.
FACTOR_STEPS = 200


class LearnedBundle:
    """The models being served, the analytic fallback, and the online corrections.

    One object behind all term predictors, so a reload swaps every term at once and the
    scheduler's :class:`Predictors` (and the observers holding its ``observe``) stay the same.
    """

    MEMO_LIMIT = 1 << 16

    def __init__(self, models: LearnedModels | None, book: DeploymentBook | None = None, *, online: bool = True,
                 alpha: float = 0.05, source: str = "", quantile_eta: float | None = None):
        self.book = book if book is not None else DeploymentBook()
        self.models = models if models is not None else LearnedModels({})
        self.source = source
        self.online = online
        self.ewma = {t: Ewma(alpha) for t in TERMS}
        self.ttft_err = Ewma(alpha)
        self._warned: set[tuple[str, str]] = set()
        self.quantile_eta = quantile_eta  # None: the step the calibration tuned (models.json), else DEFAULT_ETA
        self.quantiles = self._trackers()
        self._fallback_prefill = _AnalyticPrefillNoMemo(self.book)
        self._fallback_tbt = AnalyticTBT(self.book)
        self._fallback_transfer = AnalyticTransfer(self.book)
        self._phys: dict[int, tuple[Roofline, float, str]] = {}
        self._inst: dict[str, _Compiled] = {}
        self._memo: dict[tuple[Hashable, ...], float] = {}
        self.reloads = 0
        # each instance's predictor group, kept current here whenever its answers may change (a
        # correction, a reload, a registration): the scheduler reads it at every decision
        # (Predictors.groups), one shared tuple per distinct group (hashed and compared in C)
        self.groups: dict[str, tuple[int, int]] = {}
        self._interned: dict[tuple[int, int], tuple[int, int]] = {}
        self._traffic: StoreTraffic | None = None  # the scheduler's, read by the store term
        self.decode_cluster = 0.0  # the cluster's decode load the scheduler set for this decision
        self._share_of, self._share = 1, 0.0  # slowest_share for the last max_tokens asked

    def attach_store_traffic(self, traffic: StoreTraffic) -> None:
        """The scheduler's hook: the store traffic it advances before each decision's terms."""
        self._traffic = traffic

    def set_decode_load(self, running_per_instance: float) -> None:
        """The scheduler's hook, once per decision: reservations per eligible decode instance."""
        self.decode_cluster = running_per_instance if running_per_instance > 0 else 0.0

    # --- models --------------------------------------------------------------------------
    def swap(self, models: LearnedModels, source: str) -> None:
        """Serve ``models`` from now on (already validated); corrections start afresh."""
        self.models, self.source = models, source
        self._memo.clear()
        self._inst.clear()
        self._warned.clear()
        self.ewma = {t: Ewma(self.ewma[t].alpha) for t in TERMS}
        self.quantiles = self._trackers()
        self.reloads += 1
        self._regroup()

    def _physics(self, instance: str) -> tuple[int, Roofline, float, str]:
        key, _ = self.book.keyed(instance)
        p = self._phys.get(key)
        if p is None:
            entry = self.book.deployment(instance)
            d = entry[0] if entry is not None else None
            if d is None:  # the book's default deployment
                from predictors.facts import load_deployment
                dd = self.book._default_deployment
                d = load_deployment(dd) if isinstance(dd, str) else dd
            group = group_of(d.name)
            p = self._phys[key] = (physics(d), d.time_scale, group)
        return key, p[0], p[1], p[2]

    def model(self, term: str, instance: str) -> tuple[TermModel | None, str]:
        tm = self.models.terms.get(term)
        if tm is None:
            return None, "analytic (no model)"
        group = self._physics(instance)[3]
        m, which = tm.for_group(group)
        return m, which if m is not None else f"analytic (no model for {group})"

    def _warn(self, term: str, why: str) -> None:
        if (term, why) not in self._warned:
            self._warned.add((term, why))
            log.warning("learned predictors: %s answered by the analytic prior: %s", term, why)

    # --- compiled forms: each term's weights folded into the physics' constants ------------
    def register(self, instance: str, deployment: Deployment, kv_capacity_tokens: int) -> None:
        """The scheduler's hook: the instance's public deployment (its compiled terms follow)."""
        self.book.set(instance, deployment, kv_capacity_tokens)
        self._inst.pop(instance, None)
        self._regroup(instance)

    def unregister(self, instance: str) -> None:
        self.book.remove(instance)
        self._inst.pop(instance, None)
        self.groups.pop(instance, None)

    def group(self, instance: str) -> tuple[int, int]:
        """The instance's predictor group for a decision's memo (scheduler/cost.py's ``TermBook``):
        instances of one deployment whose prefill corrections are in the same step answer alike.
        From the first call on, :attr:`groups` holds it, kept current."""
        g = self.groups.get(instance)
        if g is None:
            g = self.groups[instance] = self._group_key(instance)
        return g

    def _group_key(self, instance: str) -> tuple[int, int]:
        key = (self._compiled(instance).key, self.prefill_step(instance))
        if len(self._interned) >= 4096:
            self._interned.clear()
        return self._interned.setdefault(key, key)

    def _regroup(self, instance: str | None = None) -> None:
        """Refresh the group of ``instance`` (None: every instance) after its answers may have changed."""
        for i in (list(self.groups) if instance is None else (instance,)):
            if i in self.groups:
                self.groups[i] = self._group_key(i)

    def _compiled(self, instance: str) -> _Compiled:
        c = self._inst.get(instance)
        if c is None:
            key, r, ts, group = self._physics(instance)
            c = self._inst[instance] = _compile(self.models, key, r, ts, group, self.book.roofline(instance))
        return c

    # --- base predictions (no online correction) ------------------------------------------
    def prefill_base(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float | None:
        c = self._compiled(instance)
        k = c.prefill
        if k is None:
            self._warn("prefill", f"no model for {c.group}")
            return None
        mk = (c.key, prompt_tokens, cached_tokens)
        t = self._memo.get(mk)
        if t is None:
            prompt = prompt_tokens if prompt_tokens > 1 else 1
            cached = cached_tokens if cached_tokens < prompt - 1 else prompt - 1
            if cached < 0:
                cached = 0
            new = prompt - cached
            sum_ctx2 = (prompt * (prompt + 1) * (2 * prompt + 1) - cached * (cached + 1) * (2 * cached + 1)) / 6.0
            t = (k[0] * -(-new // CHUNK_TOKENS) + k[1] * new + k[2] * new * (cached + (new + 1) / 2.0)
                 + k[3] * sum_ctx2)
            if len(self._memo) >= self.MEMO_LIMIT:
                self._memo.clear()
            self._memo[mk] = t
        return t

    def tbt_base(self, state: DecodeState, prompt_tokens: int, max_tokens: int,
                 cluster: float | None = None) -> float | None:
        """``cluster``: the decode load a record was decided with (None: the current decision's)."""
        c = self._compiled(state.instance)
        k = c.tbt
        if k is None:
            self._warn("tbt", f"no model for {c.group}")
            return None
        kv = (state.kv_tokens if state.kv_tokens > 0 else 0) + (prompt_tokens if prompt_tokens > 0 else 0) + (
            max_tokens if max_tokens > 1 else 1)
        if max_tokens != self._share_of:  # every candidate of a decision asks with the same max_tokens
            self._share_of, self._share = max_tokens, slowest_share(max_tokens - 1 if max_tokens > 1 else 0)
        return (k[0] + k[1] * kv + k[2] * ((state.running if state.running > 0 else 0) + 1) + k[3] * self._share
                + k[4] * (self.decode_cluster if cluster is None else cluster))

    def transfer_base(self, tokens: int, source: str, destination: str, busy_s: float | None = None) -> float | None:
        """``busy_s``: the store links' busy time to use (default: the attached traffic's now)."""
        c = self._compiled(destination)
        if source == Tier.STORE or source == Tier.HOST:  # a load before the prefill (its own term)
            if source == Tier.STORE:
                s = c.store
                if s is None:
                    self._warn(str(source), f"no model of loads from the {source} for {c.group}")
                    return None
                if busy_s is None:
                    busy_s = self._traffic.busy_s if self._traffic is not None else 0.0
                busy, own = busy_s, tokens * s[2]
                return s[0] + tokens * s[1] + (s[3] * (busy - own) if busy > own else 0.0)
            k = c.host
            if k is None:
                self._warn(str(source), f"no model of loads from the {source} for {c.group}")
                return None
            return k[0] + tokens * k[1]
        k = c.transfer
        if k is None:
            self._warn("transfer", f"no model for {c.group}")
            return None
        src_bw = self.book.roofline(source).net_bytes_per_s
        return k[0] + tokens * k[1] / (src_bw if src_bw < c.net_bytes_per_s else c.net_bytes_per_s)

    # --- served predictions -----------------------------------------------------------------
    def prefill_time(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float:
        t = self.prefill_base(instance, prompt_tokens, cached_tokens)
        if t is None:
            return self._fallback_prefill.prefill_time(instance, prompt_tokens, cached_tokens)
        return t * self.prefill_step(instance) / FACTOR_STEPS if self.online else t

    def prefill_step(self, instance: str) -> int:
        """The instance's prefill correction in steps of 1/FACTOR_STEPS: instances in the same
        step and deployment answer alike, so a decision still computes their terms once."""
        return round(self.ewma["prefill"].factor.get(instance, 1.0) * FACTOR_STEPS)

    def tbt(self, state: DecodeState, prompt_tokens: int, max_tokens: int) -> float:
        t = self.tbt_base(state, prompt_tokens, max_tokens)
        if t is None:
            return self._fallback_tbt.tbt(state, prompt_tokens, max_tokens)
        return t * self.ewma["tbt"].factor.get(self._compiled(state.instance).group_key, 1.0) if self.online else t

    def tbt_many(self, states: Sequence[DecodeState], prompt_tokens: int, max_tokens: int) -> list[float]:
        """:meth:`tbt` for every decode candidate of a decision in one call (64 of them at 64D):
        the same arithmetic in the same order, without three Python calls per candidate.
        tests/test_learned_tbt_many.py holds it equal to :meth:`tbt`: change both together."""
        inst, compiled = self._inst, self._compiled
        extra = (prompt_tokens if prompt_tokens > 0 else 0) + (max_tokens if max_tokens > 1 else 1)
        if max_tokens != self._share_of:
            self._share_of, self._share = max_tokens, slowest_share(max_tokens - 1 if max_tokens > 1 else 0)
        share, cluster = self._share, self.decode_cluster
        factor = self.ewma["tbt"].factor.get if self.online else None
        out: list[float] = []
        for state in states:
            c = inst.get(state.instance)
            if c is None:
                c = compiled(state.instance)
            k = c.tbt
            if k is None:  # no model: the warning and the analytic fallback, as tbt() gives them
                out.append(self.tbt(state, prompt_tokens, max_tokens))
                continue
            kv = (state.kv_tokens if state.kv_tokens > 0 else 0) + extra
            t = (k[0] + k[1] * kv + k[2] * ((state.running if state.running > 0 else 0) + 1) + k[3] * share
                 + k[4] * cluster)
            out.append(t if factor is None else t * factor(c.group_key, 1.0))
        return out

    def _tbt(self, state: DecodeState, prompt_tokens: int, max_tokens: int, cluster: float | None) -> float:
        """:meth:`tbt` for a record: with the cluster's decode load it was decided with."""
        t = self.tbt_base(state, prompt_tokens, max_tokens, cluster)
        if t is None:
            return self._fallback_tbt.tbt(state, prompt_tokens, max_tokens)
        return t * self.ewma["tbt"].factor.get(self._compiled(state.instance).group_key, 1.0) if self.online else t

    def transfer_time(self, tokens: int, source: str, destination: str) -> float:
        if tokens <= 0 or source == destination:
            return 0.0
        t = self.transfer_base(tokens, source, destination)
        if t is None:
            return self._fallback_transfer.transfer_time(tokens, source, destination)
        if not self.online:
            return t
        term = str(source) if source == Tier.STORE or source == Tier.HOST else "transfer"
        return t * self.ewma[term].factor.get(self._compiled(destination).group_key, 1.0)

    # --- online quantile tracking of the p90 (predictors/online_quantile.py) ---------------
    def _trackers(self) -> dict[str, QuantileTracker]:
        """Fresh trackers (at start and at every reload: a new model has its own calibration)."""
        oq = self.models.meta.get("online_quantile")
        eta = self.quantile_eta if self.quantile_eta is not None else (
            oq.get("eta", DEFAULT_ETA) if isinstance(oq, dict) else DEFAULT_ETA)
        q = self.models.meta.get("quantile", 0.9)
        try:
            return {t: QuantileTracker(float(q), float(eta)) for t in QUANTILE_TERMS}
        except (TypeError, ValueError) as e:  # a hand-edited meta: the defaults, logged once
            self._warn("p90", f"online quantile settings refused ({e}); q 0.9, eta {DEFAULT_ETA}")
            return {t: QuantileTracker(0.9, DEFAULT_ETA) for t in QUANTILE_TERMS}

    def p90(self, term: str, key: str, calibrated: float) -> float:
        """The served p90 of ``term`` (prefill, tbt, handover, ttft): the calibrated quantile times
        its tracker's scale for ``key`` (the instance's :attr:`_Compiled.group_key`; ttft: "all")."""
        return calibrated * self.quantiles[term].get(key) if self.online else calibrated

    def _upper(self, term: str, instance: str, x: Sequence[float]) -> float | None:
        """The model's calibrated upper quantile at features ``x`` (None: no model answers)."""
        m = self.model(term, instance)[0]
        return None if m is None else m.upper(x)

    def _track(self, rec: RequestRecord, p: str | None, d: str | None, lone: bool) -> None:
        """Each tracked term's outcome in ``rec`` against its calibrated p90 at its decision."""
        if rec.decided_s is None or rec.end_s is None:
            return
        t0, now = rec.decided_s, rec.end_s
        mt = rec.max_tokens or rec.output_tokens
        pre = ship = step = None
        if p is not None and p != d:
            _, rp, ts, _ = self._physics(p)
            pre = self._upper("prefill", p, prefill_features(rp, ts, rec.prompt_tokens, rec.hit_tokens))
            if lone and pre is not None and rec.prefill_start_s is not None and rec.prefill_end_s is not None:
                self.quantiles["prefill"].update(self._compiled(p).group_key, rec.prefill_end_s - rec.prefill_start_s,
                                                 pre, t0, now)
        if d is not None:
            _, rd, tsd, _ = self._physics(d)
            x = tbt_features(rd, tsd, rec.decode_running, rec.decode_kv_tokens, rec.prompt_tokens, mt,
                             rec.decode_cluster_running or 0.0)
            up = self._upper("tbt", d, x)
            m = self.model("tbt", d)[0]
            step = None if m is None else m.predict(x)
            if up is not None and len(rec.token_times) > MIN_TBT_INTERVALS:
                self.quantiles["tbt"].update(self._compiled(d).group_key, rec.tbt_s, up, t0, now)
            if p is not None and p != d:
                bw = min(self._physics(p)[1].net_bytes_per_s, rd.net_bytes_per_s)
                ship = self._upper("transfer", d, transfer_features(rd, tsd, rec.prompt_tokens, bw))
                if (ship is not None and step is not None and not rec.predicted_decode_wait_s
                        and rec.first_token_s is not None and rec.prefill_end_s is not None):
                    self.quantiles["handover"].update(self._compiled(d).group_key,
                                                      rec.first_token_s - rec.prefill_end_s, ship + step, t0, now)
        if pre is not None and ship is not None and step is not None and rec.ttft_s:
            queue = rec.predicted_queue_s or 0.0
            self.quantiles["ttft"].update("all", rec.ttft_s, (queue + pre + ship + step) * self.models.ttft_p90_scale,
                                          t0, now)

    # --- online correction: each term from observations of that term ----------------------
    def correction_key(self, term: str, instance: str) -> str:
        """Prefill is corrected per instance (its observations, lone prefills, do not depend on
        load). TBT and the KV shipment are corrected per deployment group: a request's TBT is
        observed a whole decode later and depends on who joined its batch since, so a
        per-instance factor makes an instance that happened to look fast attract the next
        requests until its TBT misses (measured: 97.2% -> 86.5% attainment at a 25 ms TBT SLO)."""
        return instance if term == "prefill" else self._compiled(instance).group_key

    def observe(self, rec: RequestRecord) -> None:
        if rec.status != "ok":
            return
        p, d = rec.prefill_instance, rec.decode_instance
        if rec.ttft_s and rec.predicted_ttft_s:
            self.ttft_err.update("all", rec.ttft_s, rec.predicted_ttft_s, rec.predicted_ttft_s)
        if self.online:
            self._track(rec, p, d, lone=rec.queue_requests == 0 and not rec.transfer_tokens
                        and not rec.host_load_tokens)
        # prefill: the leg of a request that found its prefill instance idle is its prefill
        if (p is not None and p != d and rec.queue_requests == 0 and rec.prefill_start_s is not None
                and rec.prefill_end_s is not None and not rec.transfer_tokens and not rec.host_load_tokens):
            base = self.prefill_base(p, rec.prompt_tokens, rec.hit_tokens)
            if base is not None:
                self.ewma["prefill"].update(p, rec.prefill_end_s - rec.prefill_start_s, base, rec.predicted_prefill_s)
                self._regroup(p)
        # a load from the store or the host tier (one kind only) by a request that found its
        # instance idle: its leg minus its (corrected) prefill, for the live error only. Not a
        # correction: the load is a small part of a leg that prefills joining the instance later
        # stretch, and the factor ran to its bound (served store legs of lone prefills in
        # operation: 27.9% MAPE corrected, 3.6% not; docs/predictors.md, "Store loads")
        store = rec.transfer_tokens if rec.transfer_from == Tier.STORE else 0
        load = (Tier.STORE, store) if store and not rec.host_load_tokens else (
            (Tier.HOST, rec.host_load_tokens) if rec.host_load_tokens and not rec.transfer_tokens else None)
        if (load is not None and p is not None and p != d and rec.queue_requests == 0
                and rec.prefill_start_s is not None and rec.prefill_end_s is not None):
            base = self.transfer_base(load[1], load[0], p, rec.store_busy_s)  # as at its decision
            if base is not None:
                loaded = rec.prefill_end_s - rec.prefill_start_s - self.prefill_time(p, rec.prompt_tokens,
                                                                                    rec.hit_tokens)
                self.ewma[str(load[0])].update(self.correction_key("store", p), loaded, base,
                                               None if rec.predicted_transfer_s is None else rec.predicted_transfer_s,
                                               correct=False)
        # TBT: the request's own token gaps against the state it was placed in
        if d is not None and len(rec.token_times) > MIN_TBT_INTERVALS:
            state = DecodeState(d, rec.decode_running, rec.decode_kv_tokens)
            base = self.tbt_base(state, rec.prompt_tokens, rec.max_tokens or rec.output_tokens,
                                 rec.decode_cluster_running or 0.0)
            if base is not None:
                self.ewma["tbt"].update(self.correction_key("tbt", d), rec.tbt_s, base, rec.predicted_tbt_s)
        # the prefill -> decode KV shipment: the hand-over gap minus the first decode step
        if (p is not None and d is not None and p != d and not rec.predicted_decode_wait_s
                and rec.prefill_end_s is not None and rec.first_token_s is not None):
            state = DecodeState(d, rec.decode_running, rec.decode_kv_tokens)
            step = self._tbt(state, rec.prompt_tokens, rec.max_tokens or rec.output_tokens,
                             rec.decode_cluster_running or 0.0)
            base = self.transfer_base(rec.prompt_tokens, p, d)
            if base is not None:
                shipped = rec.first_token_s - rec.prefill_end_s - step
                self.ewma["transfer"].update(self.correction_key("transfer", d), shipped, base,
                                             rec.predicted_kv_transfer_s)

    # --- what /admin/predictors shows ------------------------------------------------------
    def status(self, instances: Sequence[str] = ()) -> dict[str, Any]:
        terms: dict[str, Any] = {"queue": {"answered_by": "ledger: the sum of queued predicted prefill seconds "
                                                         "(Mooncake's T_queue over the prefill term below)"}}
        for t in TERMS:
            e = self.ewma[t]
            per: dict[str, Any] = {}
            for i in instances:
                m, which = self.model(t, i)
                k = self.correction_key(t, i)
                per[i] = {"model": which, "corrected_by": k, "correction": round(e.get(k), 4),
                          "observations": e.count.get(k, 0),
                          "live_abs_error": None if k not in e.abs_err else round(e.abs_err[k], 4)}
                qt = _TRACKED_AS.get(t)
                if qt is not None:  # the served p90: its tracker's scale and live coverage (the group's)
                    per[i].update(self.quantiles[qt].status(self._compiled(i).group_key))
            terms[t] = {"features": list(FEATURES[t]), "instances": per}
        err = self.ttft_err.abs_err.get("all")
        return {"predictors": "learned", "source": self.source, "reloads": self.reloads, "online": self.online,
                "meta": self.models.meta, "terms": terms,
                "ttft": {"observations": self.ttft_err.count.get("all", 0),
                         "live_abs_error": None if err is None else round(err, 4),
                         **self.quantiles["ttft"].status("all")},
                "p90_tracking": {"eta": self.quantiles["ttft"].eta, "q": self.quantiles["ttft"].q}}


class _AnalyticPrefillNoMemo:
    """The analytic prefill as the learned bundle's fallback (the bundle memoises itself)."""

    def __init__(self, book: DeploymentBook):
        self.book = book

    def prefill_time(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float:
        from predictors.analytic import roofline_prefill_s
        return roofline_prefill_s(self.book.roofline(instance), int(prompt_tokens), int(cached_tokens))


@dataclass
class LearnedPredictors(Predictors):
    """The scheduler's bundle over a :class:`LearnedBundle` (``bundle`` for reload and status)."""

    bundle: LearnedBundle | None = None
    watch: str | None = None  # the directory whose models.json is reloaded when it changes
    _seen: float | None = None  # mtime of the last models.json tried (served or refused)

    def reload(self, directory: str) -> LearnedModels:
        """Validate ``DIR/models.json`` and only then serve it; :class:`ModelError` keeps the old."""
        assert self.bundle is not None
        seen = _mtime(directory)
        models = load_models(directory)
        self.bundle.swap(models, os.path.abspath(directory))
        self.watch, self._seen = directory, seen  # a refused directory changes neither
        return models

    def reload_if_changed(self) -> bool:
        """Reload the watched directory's models.json if it changed since it was last tried (the
        gateway calls this every health poll); a broken new file is logged once and refused."""
        if self.watch is None:
            return False
        m = _mtime(self.watch)
        if m is None or m == self._seen:
            return False
        try:
            self.reload(self.watch)
        except ModelError as e:
            self._seen = m  # refused once, not at every poll
            log.warning("learned predictors: changed model file refused, previous models keep serving: %s", e)
            return False
        log.info("learned predictors: reloaded %s (file changed)", self.watch)
        return True


def _mtime(directory: str) -> float | None:
    try:
        return os.stat(os.path.join(directory, MODELS_FILE)).st_mtime_ns / 1e9
    except OSError:
        return None


def learned_predictors(model_dir: str | None = None, *, models: LearnedModels | None = None,
                       prior: Prior | None = None, online: bool = True, alpha: float = 0.05,
                       strict: bool = True, quantile_eta: float | None = None) -> LearnedPredictors:
    """The learned bundle from ``model_dir`` (or ``models``); ``strict`` False serves the analytic
    prior for every term when the directory holds no valid model (logged) instead of raising."""
    source = ""
    if models is None and model_dir is not None:
        try:
            models = load_models(model_dir)
            source = os.path.abspath(model_dir)
        except ModelError as e:
            if strict:
                raise
            log.warning("learned predictors: %s; every term answered by the analytic prior", e)
    book = DeploymentBook(prior=Prior() if prior is None else prior)
    b = LearnedBundle(models, book, online=online, alpha=alpha, source=source, quantile_eta=quantile_eta)
    # online: instances alike in deployment and prefill correction share a group (computed once per decision)
    group: Callable[[str], Hashable] = b.group if online else (lambda i: book.keyed(i)[0])
    p = LearnedPredictors(queue=AnalyticQueue(), prefill=b, transfer=b, tbt=b, group=group, register=b.register,
                          unregister=b.unregister, groups=b.groups if online else None,
                          decode_load=b.set_decode_load, bundle=b, watch=model_dir)
    p._seen = None if model_dir is None else _mtime(model_dir)
    return p
