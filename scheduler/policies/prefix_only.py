"""``prefix_only``: the open-source Mooncake conductor's example proxy.

Source: ``kvcache-ai/Mooncake`` ``mooncake-conductor/example/cache_aware_disagg_proxy.py``: the
conductor indexer reports, per prefill instance, its longest matched prefix over its tiers
(device, host, disk/store); the proxy sends prefill to the longest match, rotating among
instances tied for it, falls back to round robin when every match is zero, and sends decode
round robin. No load, queue or SLO enters. The shared store counts for every instance, as each
engine's connector can load from it.
"""
from __future__ import annotations

from typing import Any

from scheduler.cost import DecisionContext, PrefillCandidate
from scheduler.policies.base import DecodeChoice, Policy, PrefillChoice

_MAX_TIE_SETS = 4096  # bound on remembered tie rotations (the proxy keeps them all)


class PrefixOnlyPolicy(Policy):
    name = "prefix_only"
    source = "Mooncake conductor example proxy (cache_aware_disagg_proxy.py): longest match, decode round robin"
    score_name = "matched_tokens (higher wins)"

    def __init__(self, **params: Any):
        super().__init__(**params)
        self._tie_offsets: dict[tuple[str, ...], int] = {}
        self._fallback = 0
        self._decode = 0
        self._pending: tuple[tuple[str, ...] | None, bool] = (None, False)

    def choose_prefill(self, ctx: DecisionContext) -> PrefillChoice:
        bs = ctx.block_size
        matched = {c.id: max(c.local_blocks, ctx.store_blocks) * bs for c in ctx.prefill}
        top = max(matched.values())
        scores = {k: float(v) for k, v in matched.items()}
        if top == 0:
            c = ctx.prefill[self._fallback % len(ctx.prefill)]
            self._pending = (None, True)
            return PrefillChoice(c, c.local, scores, "no instance holds any prefix: round-robin fallback")
        leaders = tuple(sorted(k for k, v in matched.items() if v == top))
        offset = self._tie_offsets.get(leaders, 0)
        chosen = leaders[offset % len(leaders)]
        self._pending = (leaders, False)
        c = next(x for x in ctx.prefill if x.id == chosen)
        tie = f", rotating among {len(leaders)} tied" if len(leaders) > 1 else ""
        return PrefillChoice(c, c.local, scores, f"longest matched prefix {top} tokens{tie}")

    def choose_decode(self, ctx: DecisionContext, prefill: PrefillCandidate) -> DecodeChoice:
        n = len(ctx.decode)
        k = self._decode % n
        scores = {x.id: float((i - k) % n) for i, x in enumerate(ctx.decode)}
        return DecodeChoice(ctx.decode[k], scores, f"round robin turn {self._decode}")

    def placed(self, ctx: DecisionContext, prefill: str, decode: str, chose_decode: bool) -> None:
        leaders, fallback = self._pending
        if fallback:
            self._fallback += 1
        elif leaders is not None:
            if len(self._tie_offsets) >= _MAX_TIE_SETS and leaders not in self._tie_offsets:
                self._tie_offsets.clear()
            self._tie_offsets[leaders] = self._tie_offsets.get(leaders, 0) + 1
        if chose_decode:
            self._decode += 1
        self._pending = (None, False)
