"""Analytic predictors: a roofline over a profile's public facts, no fitted data.

Uses only what a datasheet and a model card say (parameters, layers, hidden size, KV bytes per
token, peak FLOP/s, memory and network bandwidth, the profile's efficiency factors); never the
simulated engine's own timing code. They are the baseline the learned predictors must beat.

* prefill = max(compute, memory) + step overhead per chunk, where compute counts the linear
  layers (2 x params x new tokens, at the profile's MFU) and causal attention over the cached
  prefix and the new tokens (4 x layers x hidden x new x (cached + new/2), at its attention MFU
  when the profile gives one), and memory reads, per chunk, the weights
  and at most the whole context's KV. At least one token is always computed (engines recompute
  the last prompt token), so a full hit costs the same as ``prompt - 1`` cached tokens.
* decode step (TBT) = max(weights + KV read / bandwidth, FLOPs / peak) + overhead, for the
  batch with this request added and its KV at its largest (prompt + max_tokens); past the KV
  capacity the step is stretched by the overcommit ratio (preemption and recompute).
* transfer = latency + tokens x KV bytes per token / bandwidth; the network and the shared
  store share the NIC bandwidth, a host-tier hit loads at host bandwidth.
* queue = the ledger's sum of predicted prefill seconds still queued (Mooncake's T_queue).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from engines_adapters.sim.profiles import GB, Profile, load_profile
from predictors.base import DecodeState, PrefillState, Predictors
from predictors.types import Tier

#: Chunked-prefill token budget per engine step (vLLM's default ``max_num_batched_tokens`` for
#: large models); only the number of steps (weight reads, overheads) depends on it.
DEFAULT_CHUNK_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class Roofline:
    """The handful of numbers the roofline needs, derived once from a profile (hashable)."""

    params: float
    layers: int
    hidden: int
    kv_bytes_per_token: int
    weight_bytes: float
    flops_per_s: float  # achievable for the linear layers: peak x MFU x GPUs
    attn_flops_per_s: float  # achievable for attention: peak x attention MFU x GPUs
    mem_bytes_per_s: float  # achievable: HBM x MBU x GPUs
    net_bytes_per_s: float
    host_bytes_per_s: float
    step_overhead_s: float
    transfer_latency_s: float
    kv_capacity_tokens: int
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    @classmethod
    def from_profile(cls, p: Profile, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> "Roofline":
        m, hw, eff = p.model, p.hardware, p.efficiency
        gpus = hw.get("gpus", 1)
        return cls(
            params=float(m["params"]),
            layers=int(m["layers"]),
            hidden=int(m["hidden"]),
            kv_bytes_per_token=p.kv_bytes_per_token,
            weight_bytes=p.weight_bytes,
            flops_per_s=hw["peak_tflops"] * 1e12 * eff["mfu"] * gpus,
            attn_flops_per_s=hw["peak_tflops"] * 1e12 * eff.get("attn_mfu", eff["mfu"]) * gpus,
            mem_bytes_per_s=hw["hbm_gbps"] * GB * eff["mbu"] * gpus,
            net_bytes_per_s=p.net_bytes_per_s,
            host_bytes_per_s=hw.get("host_gbps", hw["net_gbps"]) * GB,
            step_overhead_s=eff["step_overhead_ms"] / 1e3,
            transfer_latency_s=eff["transfer_latency_ms"] / 1e3,
            kv_capacity_tokens=max(1, p.kv_capacity_tokens),
            chunk_tokens=chunk_tokens,
        )


def roofline_prefill_s(r: Roofline, prompt_tokens: int, cached_tokens: int) -> float:
    """Prefill seconds for ``prompt_tokens`` with ``cached_tokens`` already on device.

    Never increases with ``cached_tokens`` and never decreases with ``prompt_tokens``.
    """
    prompt = max(1, prompt_tokens)
    cached = min(max(0, cached_tokens), prompt - 1)  # the last prompt token is always computed
    new = prompt - cached
    compute_s = (2.0 * r.params * new / r.flops_per_s
                 + 4.0 * r.layers * r.hidden * new * (cached + new / 2.0) / r.attn_flops_per_s)
    steps = math.ceil(new / r.chunk_tokens)
    memory_bytes = steps * (r.weight_bytes + prompt * r.kv_bytes_per_token)  # per step: weights + context KV
    return max(compute_s, memory_bytes / r.mem_bytes_per_s) + steps * r.step_overhead_s


def roofline_decode_step_s(r: Roofline, batch: int, kv_tokens: int) -> float:
    """One decode step for ``batch`` sequences holding ``kv_tokens`` KV tokens in total."""
    batch = max(1, batch)
    kv = max(0, kv_tokens)
    memory = (r.weight_bytes + kv * r.kv_bytes_per_token) / r.mem_bytes_per_s
    compute = 2.0 * r.params * batch / r.flops_per_s + 4.0 * r.layers * r.hidden * kv / r.attn_flops_per_s
    step = max(memory, compute) + r.step_overhead_s
    if kv > r.kv_capacity_tokens:  # overcommitted: preemption and recompute stretch every step
        step *= kv / r.kv_capacity_tokens
    return step


class ProfileBook:
    """Which roofline each instance runs on; the scheduler keeps it in step with registration.

    Equal rooflines share one small integer key, so memoised predictions are shared by every
    instance of a profile and never confused across profiles.
    """

    def __init__(self, profiles: dict[str, str | Profile] | None = None, default: str = "llama3-8b-h200"):
        self._default_name = default
        self._default: tuple[int, Roofline] | None = None
        self._keys: dict[Roofline, int] = {}
        self._by_instance: dict[str, tuple[int, Roofline]] = {}
        for instance, profile in (profiles or {}).items():
            self.set(instance, profile)

    def _intern(self, r: Roofline) -> tuple[int, Roofline]:
        return self._keys.setdefault(r, len(self._keys)), r

    def set(self, instance: str, profile: str | Profile) -> None:
        p = load_profile(profile) if isinstance(profile, str) else profile
        self._by_instance[instance] = self._intern(Roofline.from_profile(p))

    def remove(self, instance: str) -> None:
        self._by_instance.pop(instance, None)

    def __contains__(self, instance: str) -> bool:
        return instance in self._by_instance

    def instances(self) -> Iterable[str]:
        return self._by_instance.keys()

    def keyed(self, instance: str) -> tuple[int, Roofline]:
        """(key, roofline) of an instance; the default profile for one it does not know."""
        kr = self._by_instance.get(instance)
        if kr is None:  # unknown instance: the default profile rather than an exception mid-decision
            if self._default is None:
                self._default = self._intern(Roofline.from_profile(load_profile(self._default_name)))
            kr = self._default
        return kr

    def roofline(self, instance: str) -> Roofline:
        return self.keyed(instance)[1]


class AnalyticQueue:
    """Mooncake's T_queue: the predicted prefill seconds already queued (from the ledger)."""

    def queue_time(self, state: PrefillState) -> float:
        return max(0.0, state.queued_s)


class AnalyticPrefill:
    """Roofline prefill, memoised per (profile, prompt, cached): candidates share most answers."""

    MEMO_LIMIT = 1 << 16

    def __init__(self, book: ProfileBook):
        self.book = book
        self._memo: dict[tuple[int, int, int], float] = {}

    def prefill_time(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float:
        key, r = self.book.keyed(instance)
        memo_key = (key, prompt_tokens, cached_tokens)
        t = self._memo.get(memo_key)
        if t is None:
            if len(self._memo) >= self.MEMO_LIMIT:
                self._memo.clear()
            t = self._memo[memo_key] = roofline_prefill_s(r, int(prompt_tokens), int(cached_tokens))
        return t


class AnalyticTransfer:
    def __init__(self, book: ProfileBook):
        self.book = book

    def transfer_time(self, tokens: int, source: str, destination: str) -> float:
        if tokens <= 0 or source == destination:
            return 0.0
        dst = self.book.roofline(destination)
        if source == Tier.HOST:
            bandwidth, latency = dst.host_bytes_per_s, dst.transfer_latency_s
        elif source == Tier.STORE:  # the store is reached over the destination's NIC
            bandwidth, latency = dst.net_bytes_per_s, dst.transfer_latency_s
        else:
            src = self.book.roofline(source)
            bandwidth = min(src.net_bytes_per_s, dst.net_bytes_per_s)
            latency = max(src.transfer_latency_s, dst.transfer_latency_s)
        return latency + tokens * dst.kv_bytes_per_token / bandwidth


class AnalyticTBT:
    def __init__(self, book: ProfileBook):
        self.book = book

    def tbt(self, state: DecodeState, prompt_tokens: int, max_tokens: int) -> float:
        r = self.book.keyed(state.instance)[1]
        kv = state.kv_tokens + prompt_tokens + (max_tokens if max_tokens > 1 else 1)
        return roofline_decode_step_s(r, state.running + 1, kv)


def analytic_predictors(book: ProfileBook) -> Predictors:
    """All four analytic predictors over one profile book."""
    return Predictors(queue=AnalyticQueue(), prefill=AnalyticPrefill(book), transfer=AnalyticTransfer(book),
                      tbt=AnalyticTBT(book), group=lambda instance: book.keyed(instance)[0])
