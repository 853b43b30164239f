"""``dynamo_cost``: NVIDIA Dynamo's KV router cost (``lib/kv-router/src/scheduling/selector``).

Per prefill worker, in blocks of ``block_size`` tokens::

    raw_prefill_blocks = (active_prefill_tokens + prompt_tokens) / block_size
    overlap_credit     = overlap_score_credit x device_blocks + host_cache_hit_weight x host_blocks
                       + disk_cache_hit_weight x disk_blocks + shared_cache_multiplier x shared_beyond_device
    cost = prefill_load_scale x max(0, raw_prefill_blocks - overlap_credit)
         + decode_blocks + decode_active_request_weight x active_requests

Defaults as Dynamo ships them: credit 1.0, host 0.75, disk 0.25, shared 0 (off), scale 1.0,
active-request weight 0, temperature 0 (argmin, random among ties; > 0 samples a softmax over
costs normalised to [0, 1]). Load is the router's own prediction (our ledger), not metrics.
In disaggregated mode the prefill router does not track decode blocks (``decode_blocks = 0``)
and the decode router forces the overlap credit to 0, so decode goes to the fewest potential
decode blocks (active + this request's). An aggregated (``both``) worker counts both terms.
Our shared store plays Dynamo's shared cache; instances have no private disk tier here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, TypeVar

from predictors.types import Role
from scheduler.cost import DecisionContext, DecodeCandidate, PrefillCandidate
from scheduler.policies.base import DecodeChoice, Policy, PrefillChoice, argmin, runner_up, softmax_pick

#: A prefill or a decode candidate: the worker kind Dynamo's cost picks among.
_C = TypeVar("_C", PrefillCandidate, DecodeCandidate)


@dataclass(frozen=True)
class DynamoParams:
    overlap_score_credit: float = 1.0
    prefill_load_scale: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.0
    decode_active_request_weight: float = 0.0
    router_temperature: float = 0.0  # 0: argmin; > 0: softmax sampling

    def __post_init__(self) -> None:
        if self.router_temperature < 0:
            raise ValueError("router_temperature must be >= 0")


class DynamoCostPolicy(Policy):
    name = "dynamo_cost"
    source = "NVIDIA Dynamo KV router worker_logit (lib/kv-router/src/scheduling/selector/default.rs)"
    score_name = "cost_blocks"
    Params = DynamoParams
    params: DynamoParams

    def prefill_cost(self, c: PrefillCandidate, ctx: DecisionContext, decode_kv_tokens: int = 0) -> float:
        p, bs, prompt = self.params, ctx.block_size, ctx.prompt_tokens
        raw = (c.state.queued_tokens + prompt) / bs
        host = c.local_blocks - c.device_blocks
        shared_beyond = max(0, ctx.store_blocks - c.device_blocks)
        credit = (p.overlap_score_credit * c.device_blocks + p.host_cache_hit_weight * host
                  + p.disk_cache_hit_weight * 0 + p.shared_cache_multiplier * shared_beyond)
        decode_blocks = 0.0
        if c.role == Role.BOTH:  # aggregated worker: its decode blocks count too
            decode_blocks = math.ceil(decode_kv_tokens / bs) + math.ceil(prompt / bs)
        return (p.prefill_load_scale * max(0.0, raw - credit) + decode_blocks
                + p.decode_active_request_weight * c.active)

    def _pick(self, items: Sequence[_C], costs: Sequence[float], ctx: DecisionContext) -> _C:
        t = self.params.router_temperature
        if t > 0:
            return softmax_pick(items, costs, t, ctx.rng)
        by_id = dict(zip((x.id for x in items), costs, strict=True))
        return argmin(items, key=lambda x: by_id[x.id], rng=ctx.rng)

    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        kv = {d.id: d.state.kv_tokens for d in ctx.decode}
        costs = [self.prefill_cost(c, ctx, kv.get(c.id, 0)) for c in ctx.prefill]
        c = self._pick(ctx.prefill, costs, ctx)
        scores = {x.id: v for x, v in zip(ctx.prefill, costs, strict=True)}
        return PrefillChoice(c, c.local, scores, f"lowest cost {scores[c.id]:.4g} blocks{runner_up(scores, c.id)}")

    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        bs, w = ctx.block_size, self.params.decode_active_request_weight
        new_blocks = math.ceil(ctx.prompt_tokens / bs)
        costs = [math.ceil(d.state.kv_tokens / bs) + new_blocks + w * d.state.running for d in ctx.decode]
        d = self._pick(ctx.decode, costs, ctx)
        scores = {x.id: float(v) for x, v in zip(ctx.decode, costs, strict=True)}
        return DecodeChoice(d, scores, f"fewest potential decode blocks {scores[d.id]:.4g}{runner_up(scores, d.id)}")
