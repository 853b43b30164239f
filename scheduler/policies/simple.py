"""Cache-blind baselines: ``round_robin``, ``random``, ``least_loaded``.

They never look at the hit map; the engine still reuses whatever prefix it holds (the
candidate's engine-default terms), so their predicted TTFT stays honest for comparison.
"""
from __future__ import annotations

from typing import Any

from scheduler.cost import DecisionContext, PrefillCandidate
from scheduler.policies.base import DecodeChoice, Policy, PrefillChoice, argmin


class RoundRobinPolicy(Policy):
    name = "round_robin"
    source = "the classic rotation (SGLang Model Gateway / vLLM router `round_robin`)"
    score_name = "turns_away"

    def __init__(self, **params: Any):
        super().__init__(**params)
        self._next_prefill = 0
        self._next_decode = 0

    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        n = len(ctx.prefill)
        k = self._next_prefill % n
        c = ctx.prefill[k]
        scores = {x.id: float((i - k) % n) for i, x in enumerate(ctx.prefill)}
        return PrefillChoice(c, c.local, scores, f"turn {self._next_prefill} of the rotation over {n} prefill")

    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        n = len(ctx.decode)
        k = self._next_decode % n
        scores = {x.id: float((i - k) % n) for i, x in enumerate(ctx.decode)}
        return DecodeChoice(ctx.decode[k], scores, f"turn {self._next_decode} of the rotation over {n} decode")

    def placed(self, ctx: DecisionContext, prefill: str, decode: str, chose_decode: bool) -> None:
        self._next_prefill += 1
        if chose_decode:
            self._next_decode += 1


class RandomPolicy(Policy):
    name = "random"
    source = "uniform random choice (Mooncake's ablation 'random'; every router's `random`)"
    score_name = "uniform"

    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        c = ctx.prefill[ctx.rng.randrange(len(ctx.prefill))]
        return PrefillChoice(c, c.local, {x.id: 0.0 for x in ctx.prefill}, "uniformly at random")

    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        d = ctx.decode[ctx.rng.randrange(len(ctx.decode))]
        return DecodeChoice(d, {x.id: 0.0 for x in ctx.decode}, "uniformly at random")


class LeastLoadedPolicy(Policy):
    """Prefill: fewest queued prefill tokens (then requests); decode: fewest running (then KV)."""

    name = "least_loaded"
    source = ("load balancing without cache awareness (Mooncake's ablation 'load balancing'; "
              "token load as SGLang's power_of_two reads it)")
    score_name = "queued_tokens | running"

    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        c = argmin(ctx.prefill, key=lambda x: (x.state.queued_tokens, x.state.queued_requests))
        scores = {x.id: float(x.state.queued_tokens) for x in ctx.prefill}
        return PrefillChoice(c, c.local, scores, f"fewest queued prefill tokens ({c.state.queued_tokens})")

    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        d = argmin(ctx.decode, key=lambda x: (x.state.running, x.state.kv_tokens))
        scores = {x.id: float(x.state.running) for x in ctx.decode}
        return DecodeChoice(d, scores, f"fewest running sequences ({d.state.running})")
