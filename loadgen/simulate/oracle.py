"""``--predictors oracle``: the cost model's terms computed by the sim engine's own timing model.

Only the simulator may do this — it owns the truth it simulates. The oracle is exact for the
things a per-request predictor can know (a lone prefill's chunked compute, a decode step at a
given batch and KV, a transfer on an idle link; noise aside), so the gap between analytic and
oracle goodput is what better predictors could still buy, and the gap between the oracle and
perfect scheduling is what no predictor can (contention, queueing order, future arrivals).
"""
from __future__ import annotations

import os
from typing import Callable

from engines_adapters.sim.profiles import Profile, load_profile
from engines_adapters.sim.timing import StepTimer, chunk_ctx
from predictors.analytic import AnalyticQueue, resident_share
from predictors.base import DecodeState, Predictors
from predictors.learned import learned_predictors
from predictors.registry import make_predictors
from predictors.types import Tier
from scheduler import Instance

from .cluster import ClusterSpec


class _Oracle:
    """Prefill, transfer and TBT of one engine profile, as the engine model times them."""

    MEMO_LIMIT = 1 << 16

    def __init__(self, profile: Profile, chunk_tokens: int, block_size: int, kv_capacity_tokens: int | None = None):
        self.timer = StepTimer(profile)
        self.kv_capacity = profile.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens
        self.chunk = chunk_tokens
        eff = profile.efficiency
        self.latency = eff.get("transfer_latency_ms", 1.0) * 1e-3
        self.kv_bytes = profile.kv_bytes_per_token
        self.net = profile.net_bytes_per_s * eff.get("net_efficiency", 1.0)  # a gap profile's congestion
        self.host = profile.host_bytes_per_s
        self.block_size = block_size
        self._memo: dict[tuple[int, int], float] = {}

    def prefill_time(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float:
        key = (prompt_tokens, cached_tokens)
        t = self._memo.get(key)
        if t is None:
            if len(self._memo) >= self.MEMO_LIMIT:
                self._memo.clear()
            prompt = max(1, prompt_tokens)
            done = min(max(0, cached_tokens), prompt - 1)
            t = 0.0
            while done < prompt:  # chunked prefill alone on the instance, one chunk a step
                n = min(self.chunk, prompt - done)
                t += self.timer.duration(n, 1, chunk_ctx(done, n), 0, n)
                done += n
            self._memo[key] = t
        return t

    def transfer_time(self, tokens: int, source: str, destination: str) -> float:
        if tokens <= 0 or source == destination:
            return 0.0
        bandwidth = self.host if source == Tier.HOST else self.net
        return self.latency + tokens * self.kv_bytes / bandwidth

    def tbt(self, state: DecodeState, prompt_tokens: int, max_tokens: int) -> float:
        # the step reads what fits: KV reserved past the capacity waits for room (the ledger's
        # decode wait), as the analytic TBT has it (docs/predictors.md)
        batch, kv = resident_share(state.running + 1, state.kv_tokens + prompt_tokens + max(1, max_tokens),
                                   self.kv_capacity, state.kv_share)
        return self.timer.duration(batch, batch, 0.0, kv)


def oracle_predictors(cluster: ClusterSpec) -> Predictors:
    engine = cluster.engine
    o = _Oracle(load_profile(cluster.profile), int(engine.get("max_num_batched_tokens", 8192)), cluster.block_size,
                engine.get("kv_capacity_tokens"))
    return Predictors(queue=AnalyticQueue(), prefill=o, transfer=o, tbt=o, group=lambda instance: 0)


def predictors_factory(name: str, cluster: ClusterSpec) -> Callable[[list[Instance]], Predictors] | None:
    """What the simulated scheduler predicts with: None = the scheduler's default (analytic)."""
    if name == "analytic":
        return None
    if name == "oracle":
        return lambda members: oracle_predictors(cluster)
    if os.path.isdir(name):  # a directory written by conductor calibrate: fresh corrections per run
        return lambda members: learned_predictors(name)
    return lambda members: make_predictors(name)
