"""The learned terms' design matrices: each telemetry row's features in its deployment's own
physical units (predictors/learned_features.py), the prior's answer beside them, and the learned
models' predictions over them (what fitting offsets and scoring compare against).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from predictors.analytic import Prior, Roofline, reserved_decode_step_s, roofline_prefill_s
from predictors.dataset import HandoverRow, PrefillRow, TBTRow
from predictors.facts import Deployment
from predictors.fit_weights import Fitted
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
from predictors.learned_models import LearnedModels, TermModels
from predictors.types import Tier


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
              cluster: float = 0.0, kv_share: float = 1.0) -> list[float]:
        return tbt_features(self.unit[dep], self.ts(dep), running, kv, prompt, max_tokens, cluster, kv_share)

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

    def analytic_tbt(self, dep: str, running: int, kv: int, prompt: int, max_tokens: int,
                     kv_share: float = 1.0) -> float:
        return reserved_decode_step_s(self.prior_roofline[dep], running + 1, kv + prompt + max(1, max_tokens), kv_share)

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
                                     r.cluster_running, r.kv_share) for r in rows]).reshape(-1, len(FEATURES["tbt"])),
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
        return ph.analytic_tbt(r.dst_deployment, r.running, r.kv_tokens, r.tokens, r.max_tokens, r.kv_share)
    return predict(tm, r.dst_deployment, ph.tbt_x(r.dst_deployment, r.running, r.kv_tokens, r.tokens, r.max_tokens,
                                                  r.cluster_running, r.kv_share))[0]
