"""``lmetric``: "Simple is Better: Multiplication May Be All You Need for LLM Request Scheduling".

Source: the LMetric proposals for SGLang Model Gateway (sgl-project/sglang#29574) and llm-d
(``lmetric-scorer``): cost = PToken x (BS + 1), minimised, where PToken is the prompt tokens the
worker would still have to prefill given its own cache and BS the requests in flight on it.
No thresholds: a cached but busy worker loses once its batch outweighs the tokens it saves.
At least one token is always prefilled (engines recompute the last prompt token), so a full
hit still pays for the batch. For decode the request brings the same work to every instance
(its KV is shipped, not reused), so the product reduces to the fewest in flight (then KV).
"""
from __future__ import annotations

from scheduler.cost import DecisionContext, PrefillCandidate
from scheduler.policies.base import DecodeChoice, Policy, PrefillChoice, argmin, runner_up


class LMetricPolicy(Policy):
    name = "lmetric"
    source = "LMetric multiplication scheduling (sglang PR #29574, llm-d lmetric-scorer)"
    score_name = "uncached_tokens x (in_flight + 1)"

    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        bs, prompt = ctx.block_size, ctx.prompt_tokens
        scores = {c.id: float(max(1, prompt - c.local_blocks * bs) * (c.active + 1)) for c in ctx.prefill}
        c = argmin(ctx.prefill, key=lambda x: scores[x.id])
        return PrefillChoice(c, c.local, scores, f"lowest uncached x batch {scores[c.id]:.4g}{runner_up(scores, c.id)}")

    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        d = argmin(ctx.decode, key=lambda x: (x.state.running, x.state.kv_tokens))
        return DecodeChoice(d, {x.id: float(x.state.running + 1) for x in ctx.decode},
                            f"smallest batch ({d.state.running} running)")
