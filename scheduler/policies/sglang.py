"""``sglang_cache_aware``: SGLang Model Gateway's ``cache_aware`` policy.

Source: ``sgl-project/sglang`` ``sgl-router/src/policies/cache_aware.rs`` and its successor
``lightseekorg/smg`` ``model_gateway/src/policies/cache_aware.rs``:

* load = requests in flight on a worker (the router's own counter);
* imbalanced when ``max - min > balance_abs_threshold`` **and** ``max > min x balance_rel_threshold``
  (defaults 64 and 1.5): then the least-loaded worker, and the request is still recorded;
* otherwise the worker with the longest prefix match in the router's *approximate tree of its own
  routing history* (per token page for pre-tokenised requests); if the match rate (matched /
  prompt tokens) exceeds ``cache_threshold`` (0.3) that worker, else the least-loaded one; a
  matched worker that is no longer healthy falls back to the first healthy one;
* in PD mode decode is the least-loaded decode worker.

The history is keyed by our block hashes (the token tree is page-aligned the same way) and
bounded to ``max_tree_blocks`` entries, least recently routed evicted first (SGLang evicts LRU
leaves periodically). ``match_source="index"`` swaps the history for the KV-event hit map.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from scheduler.cost import DecisionContext, PrefillCandidate
from scheduler.policies.base import DecodeChoice, Policy, PrefillChoice, argmin


class RoutingHistory:
    """Approximate per-worker prefix record: block hash -> the worker it was last routed to."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self._owner: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, hashes: list[int]) -> tuple[int, str | None]:
        """Longest recorded prefix (blocks) and the worker that last routed all of it."""
        owner = self._owner
        k = 0
        for h in hashes:
            if h not in owner:
                break
            k += 1
        return k, (owner[hashes[k - 1]] if k else None)

    def insert(self, hashes: list[int], worker: str) -> None:
        owner = self._owner
        for h in hashes:
            owner.pop(h, None)  # re-insert: most recently routed goes last
            owner[h] = worker
        excess = len(owner) - self.max_blocks
        if excess > 0:  # evict the least recently routed blocks
            it = iter(owner)
            for h in [next(it) for _ in range(excess)]:
                del owner[h]


@dataclass(frozen=True)
class SGLangParams:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    match_source: Literal["history", "index"] = "history"
    max_tree_blocks: int = 1 << 20

    def __post_init__(self) -> None:
        if self.max_tree_blocks <= 0:
            raise ValueError("max_tree_blocks must be positive")


class SGLangCacheAwarePolicy(Policy):
    name = "sglang_cache_aware"
    source = "SGLang Model Gateway cache_aware (sgl-router / smg cache_aware.rs), decode least-loaded"
    score_name = "in_flight_requests"
    Params = SGLangParams
    params: SGLangParams

    def __init__(self, **params: Any):
        super().__init__(**params)
        self.history = RoutingHistory(self.params.max_tree_blocks)

    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        p = self.params
        loads = {c.id: c.active for c in ctx.prefill}
        scores = {k: float(v) for k, v in loads.items()}
        lo, hi = min(loads.values()), max(loads.values())
        least = argmin(ctx.prefill, key=lambda c: c.active)
        if hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold:
            return PrefillChoice(least, least.local, scores, f"load imbalanced (max {hi}, min {lo}): least loaded")
        matched, tenant = self._match(ctx)
        rate = matched * ctx.block_size / ctx.prompt_tokens
        extra = {"match_rate": rate, "matched_instance": tenant}
        if rate > p.cache_threshold:
            chosen = next((c for c in ctx.prefill if c.id == tenant), None)
            if chosen is None:  # matched worker gone or unhealthy: SGLang falls back to the first healthy
                chosen = ctx.prefill[0]
                return PrefillChoice(chosen, chosen.local, scores, f"matched {tenant} is unavailable: first healthy",
                                     extra=extra)
            return PrefillChoice(chosen, chosen.local, scores,
                                 f"match rate {rate:.2f} > {p.cache_threshold}: cache affinity", extra=extra)
        return PrefillChoice(least, least.local, scores,
                             f"match rate {rate:.2f} <= {p.cache_threshold}: least loaded", extra=extra)

    def _match(self, ctx: DecisionContext) -> tuple[int, str | None]:
        if self.params.match_source == "history":
            return self.history.match(ctx.facts.block_hashes)
        best = argmin(ctx.prefill, key=lambda c: -c.local_blocks)
        return (best.local_blocks, best.id) if best.local_blocks else (0, None)

    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        d = argmin(ctx.decode, key=lambda x: x.state.running)
        return DecodeChoice(d, {x.id: float(x.state.running) for x in ctx.decode},
                            f"least loaded decode ({d.state.running} in flight)")

    def placed(self, ctx: DecisionContext, prefill: str, decode: str, chose_decode: bool) -> None:
        if self.params.match_source == "history":
            self.history.insert(ctx.facts.block_hashes, prefill)
