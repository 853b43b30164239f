"""The learned predictors' features: each term's physical quantities at 100% efficiency.

A feature is what a term costs an instance's public :class:`~predictors.facts.Deployment` at
peak rates (seconds of linear compute, of attention, of weight and KV reads, of bytes over the
NIC); a fitted weight is then an inverse efficiency, or a fixed cost in the hardware's own time
(predictors/learned.py). ``conductor calibrate`` builds its rows with these functions; the
gateway serves their closed forms (predictors/learned_compiled.py), the same constants folded
into the weights.
"""
from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist
from typing import Sequence

from predictors.analytic import Prior, Roofline, resident_share
from predictors.facts import TIME_SCALE_SEP, Deployment
from predictors.types import Tier

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
                 max_tokens: int, cluster_running: float = 0.0, kv_share: float = 1.0) -> list[float]:
    """A decode step once this request joins, at peak rates: the weight read (what every step
    costs: overhead, launch, weights), the KV read (at the request's largest, as the analytic
    TBT) and the batch's linear FLOPs (what each sequence adds: FLOPs, sampling, bookkeeping);
    then what decides the slowest 10% of its gaps: the weight read times :func:`slowest_share` of
    its gaps (a longer decode sees more of the step's spread and of the batch's swings), and the
    per-sequence FLOPs times the cluster's decode load (reservations per decode instance, which
    the scheduler spreads over the instances: the batch this one drifts to after placement).
    The batch and KV are what runs of the reservations (:func:`~predictors.analytic.resident_share`
    at the deployment's public capacity estimate, holding 1 / ``kv_share`` of it in context where
    the sequences share prefix blocks): past it, the excess waits for room."""
    batch, kv = resident_share(max(0, running) + 1, max(0, kv_tokens) + max(0, prompt_tokens) + max(1, max_tokens),
                               r.kv_capacity_tokens, kv_share)
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

