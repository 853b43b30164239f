"""Analytic predictors: a roofline over a deployment's public facts and a prior of public rules
of thumb; nothing fitted to, or read from, any engine.

What a datasheet and a model card say (parameters, layers, hidden size, KV bytes per token, peak
FLOP/s, memory and network bandwidth: :mod:`predictors.facts`) plus a :class:`Prior` of how
efficiently LLM serving typically uses such hardware. They are the baseline the learned
predictors must beat, and are graded against engines they share no constants with.

* prefill = max(compute, memory) + step overhead per chunk, where compute counts the linear
  layers (2 x params x new tokens, at the prior's prefill MFU) and causal attention over the
  cached prefix and the new tokens (4 x layers x hidden x new x (cached + new/2), at its
  attention MFU), and memory reads, per chunk, the weights and at most the whole context's KV.
  At least one token is always computed (engines recompute the last prompt token), so a full
  hit costs the same as ``prompt - 1`` cached tokens.
* decode step (TBT) = max(weights + KV read / bandwidth, FLOPs / peak) + overhead, for the
  batch with this request added and its KV at its largest (prompt + max_tokens), at most the KV
  capacity: a vLLM-class engine admits a request only once its prompt's blocks fit (and preempts
  the newest when running ones outgrow the cache), so what is reserved past the capacity waits for
  room (the ledger's decode wait, part of TTFT) and is not read by the step. Counting it in the
  step as well predicted 0.17 s steps where the engine ran 0.05 s and 20 s waits for room that
  took 3-5 s (docs/predictors.md). ``roofline_decode_step_s`` itself still stretches a step past
  the capacity by the overcommit ratio, for callers that pass KV already resident.
* transfer = latency + tokens x KV bytes per token / bandwidth; the network and the shared
  store share the NIC bandwidth, a host-tier hit loads at host bandwidth.
* queue = the ledger's sum of predicted prefill seconds still queued (Mooncake's T_queue).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from predictors.base import DecodeState, Predictors, PrefillState
from predictors.facts import Deployment, load_deployment
from predictors.types import Tier

#: Chunked-prefill token budget per engine step (vLLM's default ``max_num_batched_tokens`` for
#: large models); only the number of steps (weight reads, overheads) depends on it.
DEFAULT_CHUNK_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class Prior:
    """Generic public rules of thumb for how well LLM serving uses the hardware (not fitted to
    any engine; overridable from the gateway config's ``[prior]`` section).

    * ``prefill_mfu`` 0.5: large dense matmuls typically reach about half of peak FLOP/s (model
      FLOPs utilisation): PaLM reports ~46% MFU on TPU v4, Megatron-LM ~52% of A100 peak for
      GPT-scale models; prefill is a large-batch matmul workload of the same kind.
    * ``attn_mfu`` 0.5: FlashAttention-2 reports roughly 50-73% of A100 peak for the attention
      forward pass; the low end, since serving kernels see ragged batches.
    * ``decode_mbu`` 0.7: decode is memory bound; Databricks' "LLM Inference Performance
      Engineering: Best Practices" defines model bandwidth utilisation (MBU) and finds
      well-tuned servers at small batch reading weights at well over half of peak bandwidth;
      0.7 is a typical value, not a figure quoted from it.
    * ``step_overhead_ms`` 2: per engine step CPU work (scheduling, sampling, kernel launch) is
      typically a few milliseconds in vLLM-class servers.
    * ``transfer_latency_ms`` 2: fixed cost of one KV transfer (RDMA setup, descriptor
      exchange), typically around a millisecond or a few.
    * ``chunk_tokens``: the chunked-prefill budget per step (vLLM's default for large models).
    * ``store_gbps`` 21.75: one load from a Mooncake-style shared store, GB/s: the Transfer
      Engine moves "up to 87 GB/s" over 4 x 200 Gbps RoCE (Mooncake README, "Performance"), one
      transfer at one NIC's share; over TCP "about 2.4x" slower (set 9.06). Never above the
      destination's NIC.

    Fixed latencies are in hardware milliseconds; a time-scaled :class:`Deployment` multiplies
    them by its ``time_scale``.
    """

    prefill_mfu: float = 0.5
    attn_mfu: float = 0.5
    decode_mbu: float = 0.7
    step_overhead_ms: float = 2.0
    transfer_latency_ms: float = 2.0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    store_gbps: float = 87.0 / 4

    def __post_init__(self) -> None:
        for name in ("prefill_mfu", "attn_mfu", "decode_mbu"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"prior {name} must be in (0, 1], got {v!r}")
        for name in ("step_overhead_ms", "transfer_latency_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"prior {name} must be >= 0, got {v!r}")
        if not isinstance(self.store_gbps, (int, float)) or self.store_gbps <= 0:
            raise ValueError(f"prior store_gbps must be > 0, got {self.store_gbps!r}")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens <= 0:
            raise ValueError(f"prior chunk_tokens must be a positive integer, got {self.chunk_tokens!r}")

    @staticmethod
    def field_names() -> list[str]:
        return [f.name for f in fields(Prior)]


@dataclass(frozen=True, slots=True)
class Roofline:
    """The handful of numbers the roofline needs, derived once from (deployment, prior); hashable."""

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
    store_bytes_per_s: float = 0.0  # a load from the shared store (0: at the NIC)

    @classmethod
    def from_deployment(cls, d: Deployment, prior: Prior = Prior(),
                        kv_capacity_tokens: int | None = None) -> "Roofline":
        """``kv_capacity_tokens`` None: the deployment's public estimate."""
        peak = d.gpu.peak_tflops * 1e12 * d.gpus
        cap = d.estimated_kv_capacity_tokens() if kv_capacity_tokens is None else kv_capacity_tokens
        return cls(
            params=float(d.model.params),
            layers=d.model.layers,
            hidden=d.model.hidden,
            kv_bytes_per_token=d.kv_bytes_per_token,
            weight_bytes=d.weight_bytes,
            flops_per_s=peak * prior.prefill_mfu,
            attn_flops_per_s=peak * prior.attn_mfu,
            mem_bytes_per_s=d.gpu.hbm_gbps * 1e9 * prior.decode_mbu * d.gpus,
            net_bytes_per_s=d.net_bytes_per_s,
            host_bytes_per_s=d.host_bytes_per_s,
            step_overhead_s=prior.step_overhead_ms / 1e3 * d.time_scale,
            transfer_latency_s=prior.transfer_latency_ms / 1e3 * d.time_scale,
            kv_capacity_tokens=max(1, cap),
            chunk_tokens=prior.chunk_tokens,
            store_bytes_per_s=min(d.net_bytes_per_s, prior.store_gbps * 1e9 / d.time_scale),
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


def roofline_decode_step_s(r: Roofline, batch: int, kv_tokens: int, kv_share: float = 1.0) -> float:
    """One decode step for ``batch`` sequences holding ``kv_tokens`` KV tokens in total
    (``kv_share``: :class:`~predictors.base.DecodeState`'s)."""
    batch = batch if batch > 1 else 1  # max() as conditionals: this runs once per decode candidate
    kv = kv_tokens if kv_tokens > 0 else 0
    memory = (r.weight_bytes + kv * r.kv_bytes_per_token) / r.mem_bytes_per_s
    compute = 2.0 * r.params * batch / r.flops_per_s + 4.0 * r.layers * r.hidden * kv / r.attn_flops_per_s
    step = (compute if compute > memory else memory) + r.step_overhead_s
    held = kv * kv_share
    if held > r.kv_capacity_tokens:  # overcommitted: preemption and recompute stretch every step
        step *= held / r.kv_capacity_tokens
    return step


class DeploymentBook:
    """Which (public deployment, prior) each instance runs on; the scheduler keeps it in step
    through the predictors' ``register`` / ``unregister`` hooks.

    Equal rooflines share one small integer key, so memoised predictions are shared by every
    instance of a deployment and never confused across deployments.
    """

    def __init__(self, deployments: dict[str, str | Deployment] | None = None, *, prior: Prior = Prior(),
                 default: str | Deployment = "llama3-8b-h200"):
        self.prior = prior
        self._default_deployment = default
        self._default: tuple[int, Roofline] | None = None
        self._keys: dict[Roofline, int] = {}
        self._by_instance: dict[str, tuple[Deployment, Prior, tuple[int, Roofline]]] = {}
        for instance, deployment in (deployments or {}).items():
            self.set(instance, deployment)

    def _intern(self, r: Roofline) -> tuple[int, Roofline]:
        return self._keys.setdefault(r, len(self._keys)), r

    def set(self, instance: str, deployment: str | Deployment, kv_capacity_tokens: int | None = None,
            prior: Prior | None = None) -> None:
        """(Re)register an instance; KeyError for an unknown deployment name."""
        d = load_deployment(deployment) if isinstance(deployment, str) else deployment
        p = self.prior if prior is None else prior
        self._by_instance[instance] = (d, p, self._intern(Roofline.from_deployment(d, p, kv_capacity_tokens)))

    def remove(self, instance: str) -> None:
        self._by_instance.pop(instance, None)

    def __contains__(self, instance: str) -> bool:
        return instance in self._by_instance

    def deployment(self, instance: str) -> tuple[Deployment, Prior] | None:
        entry = self._by_instance.get(instance)
        return None if entry is None else entry[:2]

    def keyed(self, instance: str) -> tuple[int, Roofline]:
        """(key, roofline) of an instance; the default deployment for one it does not know."""
        entry = self._by_instance.get(instance)
        if entry is not None:
            return entry[2]
        if self._default is None:  # unknown instance: the default rather than an exception mid-decision
            d = self._default_deployment
            d = load_deployment(d) if isinstance(d, str) else d
            self._default = self._intern(Roofline.from_deployment(d, self.prior))
        return self._default

    def roofline(self, instance: str) -> Roofline:
        return self.keyed(instance)[1]


class AnalyticQueue:
    """Mooncake's T_queue: the predicted prefill seconds already queued (from the ledger)."""

    def queue_time(self, state: PrefillState) -> float:
        q = state.queued_s
        return q if q > 0.0 else 0.0  # max(0.0, q) without the builtin's call (once per candidate)


class AnalyticPrefill:
    """Roofline prefill, memoised per (roofline, prompt, cached): candidates share most answers."""

    MEMO_LIMIT = 1 << 16

    def __init__(self, book: DeploymentBook):
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
    def __init__(self, book: DeploymentBook):
        self.book = book

    def transfer_time(self, tokens: int, source: str, destination: str) -> float:
        if tokens <= 0 or source == destination:
            return 0.0
        dst = self.book.roofline(destination)
        if source == Tier.HOST:
            bandwidth, latency = dst.host_bytes_per_s, dst.transfer_latency_s
        elif source == Tier.STORE:  # one store transfer, reached over the destination's NIC
            bandwidth, latency = dst.store_bytes_per_s or dst.net_bytes_per_s, dst.transfer_latency_s
        else:
            src = self.book.roofline(source)
            bandwidth = min(src.net_bytes_per_s, dst.net_bytes_per_s)
            latency = max(src.transfer_latency_s, dst.transfer_latency_s)
        return latency + tokens * dst.kv_bytes_per_token / bandwidth


def resident_share(batch: int, kv_tokens: int, cap: int, kv_share: float = 1.0) -> tuple[int, int]:
    """The batch and KV a decode step runs when the ledger has reserved ``kv_tokens`` on an
    instance holding ``cap``: past the capacity the excess waits for room (the ledger's decode
    wait), so the step reads a full cache and carries the batch's share that fits. A full cache
    whose sequences share prefix blocks (``kv_share`` < 1) holds ``cap / kv_share`` tokens of
    context, and the step reads them all."""
    if 0.0 < kv_share < 1.0:  # (a share of 0 or less means nothing: no sharing assumed)
        cap = int(cap / kv_share)
    if kv_tokens > cap:
        return max(1, int(batch * cap / kv_tokens)), cap
    return batch, kv_tokens


def reserved_decode_step_s(r: Roofline, batch: int, kv_tokens: int, kv_share: float = 1.0) -> float:
    """The decode step of what the ledger has reserved on an instance (:func:`resident_share`)."""
    return roofline_decode_step_s(r, *resident_share(batch, kv_tokens, r.kv_capacity_tokens, kv_share), kv_share)


class AnalyticTBT:
    def __init__(self, book: DeploymentBook):
        self.book = book

    def tbt(self, state: DecodeState, prompt_tokens: int, max_tokens: int) -> float:
        r = self.book.keyed(state.instance)[1]
        return reserved_decode_step_s(r, state.running + 1, state.kv_tokens + prompt_tokens
                                      + (max_tokens if max_tokens > 1 else 1), state.kv_share)


def analytic_predictors(book: DeploymentBook | None = None, *, prior: Prior | None = None) -> Predictors:
    """All four analytic predictors over one deployment book (a new, empty one by default),
    with the hooks that keep the book in step with the scheduler's instances."""
    if book is None:
        book = DeploymentBook(prior=Prior() if prior is None else prior)
    elif prior is not None:
        raise ValueError("pass the prior to the DeploymentBook, not with an existing book")
    keyed = book.keyed
    return Predictors(queue=AnalyticQueue(), prefill=AnalyticPrefill(book), transfer=AnalyticTransfer(book),
                      tbt=AnalyticTBT(book), group=lambda instance: keyed(instance)[0],
                      register=book.set, unregister=book.remove)
