"""One instance's learned terms in closed form (what :class:`~predictors.learned.LearnedBundle`
serves): each term model's weights folded into its deployment's physical constants, so a
prediction is a handful of multiplications instead of a feature vector and a dot product.
"""
from __future__ import annotations

from dataclasses import dataclass

from predictors.analytic import Roofline
from predictors.learned_features import CTX_SCALE, load_features
from predictors.learned_models import TBT_KV_SHARE, LearnedModels, TermModel
from predictors.types import Tier


@dataclass(frozen=True, slots=True)
class CompiledTerms:
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
    kv_capacity_tokens: int  # the TBT features' capacity (the deployment's public estimate)
    tbt_kv_share: bool  # the TBT was fitted at its rows' KV share: serve it at the instance's


def compile_terms(models: LearnedModels, key: int, r: Roofline, ts: float, group: str,
                  served: Roofline) -> CompiledTerms:
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
    return CompiledTerms(
        key, group, f"group:{group}", served.net_bytes_per_s,
        None if p is None else (p.coef[0] * weights, p.coef[1] * 2.0 * r.params / r.flops_per_s, p.coef[2] * attn,
                                p.coef[3] * attn / CTX_SCALE),
        None if t is None else (t.coef[0] * weights, t.coef[1] * r.kv_bytes_per_token / r.mem_bytes_per_s,
                                t.coef[2] * 2.0 * r.params / r.flops_per_s, t.coef[3] * weights,
                                t.coef[4] * 2.0 * r.params / r.flops_per_s),
        None if x is None else (x.coef[0] * ts, x.coef[1] * r.kv_bytes_per_token),
        store(), load("host", Tier.HOST), r.kv_capacity_tokens, models.meta.get(TBT_KV_SHARE) is True)
