"""Step time of one forward pass, from a profile's public facts and a per-operator roofline.

The operators of a transformer step run one after another, so their times add:

* linear layers (QKV, O, MLP, LM head): ``blend(compute, memory)`` with
  compute = 2 x matmul params x tokens / (gpus x peak x mfu) and
  memory = weight bytes / (gpus x HBM bandwidth x mbu). ``blend`` is the p-norm
  ``(c^p + m^p)^(1/p)``: a plain ``max`` (p = inf) underestimates the knee between the memory-
  and compute-bound regimes by up to 30% against measured GEMM times; p = 2 fits within ~10%
  (14% worst, Vidur's A100 profiles of Llama-3-8B and -70B, 1..8192 tokens).
* prefill attention (compute bound): 4 x layers x hidden x sum over new tokens of their context
  FLOPs (QK^T and PV, causal; all query heads count, GQA only shrinks the KV bytes), at attn_mfu.
* decode attention (memory bound): KV bytes read = kv_bytes_per_token x sum of decode contexts,
  at attn_mbu. GQA enters through kv_bytes_per_token (kv_heads, not heads).
* tensor-parallel all-reduce (gpus > 1): two per layer, latency + tokens x hidden x dtype / bw.
* a fixed per-step overhead (scheduling, sampling, launch).

"Gap" profiles (``*-gap`` in profiles.json) depart further from the roofline, the way measured
hardware does, through optional calibration keys (absent: the plain model above, unchanged):
``gpu_speed`` (sustained fraction of the datasheet FLOP/s: power capping, clocks, a slower part),
``mfu_half_tokens`` (linear-layer efficiency rises with the step's tokens as
``tokens / (tokens + half)``: tile and wave quantisation at small batches), ``attn_ctx_knee``
(prefill attention efficiency falls with the mean context ``c`` of the step's prefill tokens as
``1 / sqrt(1 + c / knee)``), ``seq_overhead_us`` (CPU per sequence per step: sampling,
detokenisation, scheduler bookkeeping). Noise and network congestion are applied by the engine
model (``extra_noise``, ``net_efficiency``). Sources and values: docs/sim_engine.md.

The derivation and the public figures behind each efficiency are in docs/sim_engine.md.
"""
from __future__ import annotations

import math

from predictors.facts import GB

from .profiles import Profile

#: Calibration keys of the gap profiles; a profile with none of them times exactly as before.
GAP_KEYS = ("gpu_speed", "mfu_half_tokens", "attn_ctx_knee", "seq_overhead_us")


class StepTimer:
    """Maps the facts of one scheduled batch to its modelled duration in seconds."""

    __slots__ = ("matmul_params", "lm_head_params", "_flops_rate", "_bytes_rate", "_attn_rate", "_kv_rate",
                 "_weight_bytes", "_p", "_attn_flops_per_ctx", "_kv_bytes", "_ar_count", "_ar_latency",
                 "_ar_bw", "_ar_bytes_per_token", "_overhead", "_memory", "_memory_p", "_inv_p", "_gap",
                 "_half_tokens", "_ctx_knee", "_seq_overhead")

    def __init__(self, profile: Profile):
        m, hw, eff = profile.model, profile.hardware, profile.efficiency
        layers, hidden = m["layers"], m["hidden"]
        kv_dim = m["kv_heads"] * m["head_dim"]
        inter = m.get("intermediate", 4 * hidden)
        vocab = m.get("vocab", 0)
        per_layer = hidden * (hidden + 2 * kv_dim) + hidden * hidden + 3 * hidden * inter
        self.matmul_params = per_layer * layers
        self.lm_head_params = hidden * vocab
        gpus = hw["gpus"]
        peak = hw["peak_tflops"] * 1e12
        hbm = hw["hbm_gbps"] * GB
        self._flops_rate = gpus * peak * eff["mfu"]
        self._bytes_rate = gpus * hbm * eff["mbu"]
        self._attn_rate = gpus * peak * eff.get("attn_mfu", eff["mfu"])
        self._kv_rate = gpus * hbm * eff.get("attn_mbu", eff["mbu"])
        self._weight_bytes = (self.matmul_params + self.lm_head_params) * m["dtype_bytes"]
        self._p = float(eff.get("roofline_blend", 2.0))
        self._attn_flops_per_ctx = 4.0 * layers * hidden
        self._kv_bytes = float(profile.kv_bytes_per_token)
        # tensor parallel: two all-reduces of the hidden states per layer; a ring all-reduce moves
        # 2(n-1)/n of the tensor through each GPU's link (bus bandwidth = link x allreduce_eff)
        self._ar_count = 2 * layers if gpus > 1 else 0
        self._ar_latency = eff.get("allreduce_latency_us", 30.0) * 1e-6
        bus = hw.get("nvlink_gbps", 100.0) * GB * eff.get("allreduce_eff", 0.5)
        self._ar_bw = bus * gpus / (2 * (gpus - 1)) if gpus > 1 else float("inf")
        self._ar_bytes_per_token = hidden * m["dtype_bytes"]
        self._overhead = eff.get("step_overhead_ms", 1.0) * 1e-3
        # constants of the per-step formula, computed once (the same floats linear() computes)
        self._memory = self._weight_bytes / self._bytes_rate
        self._memory_p = self._memory**self._p
        self._inv_p = 1.0 / self._p
        # the gap profiles' departures from the roofline (docs/sim_engine.md, "Gap profiles")
        self._gap = any(k in eff for k in GAP_KEYS)
        speed = float(eff.get("gpu_speed", 1.0))
        if not 0 < speed <= 1:
            raise ValueError(f"profile {profile.name}: gpu_speed must be in (0, 1], got {speed}")
        if self._gap:
            self._flops_rate *= speed
            self._attn_rate *= speed
        self._half_tokens = float(eff.get("mfu_half_tokens", 0.0))
        self._ctx_knee = float(eff.get("attn_ctx_knee", 0.0))
        self._seq_overhead = float(eff.get("seq_overhead_us", 0.0)) * 1e-6

    def linear(self, tokens: int, seqs: int, lm_head: bool = True) -> float:
        """Linear layers for ``tokens`` new tokens, of which ``seqs`` are sampled (LM head;
        ``lm_head=False`` leaves it out, to compare with per-layer operator profiles)."""
        head = self.lm_head_params if lm_head else 0
        compute = 2.0 * (self.matmul_params * tokens + head * seqs) / self._flops_rate
        memory = self._weight_bytes / self._bytes_rate
        if not lm_head:
            memory *= self.matmul_params / (self.matmul_params + self.lm_head_params)
        p = self._p
        if p >= 64:
            return compute if compute > memory else memory
        return (compute**p + memory**p) ** (1.0 / p)

    def one_allreduce(self, nbytes: float) -> float:
        """One tensor-parallel all-reduce of ``nbytes`` (on this profile's GPUs and links)."""
        return self._ar_latency + nbytes / self._ar_bw

    def allreduce(self, tokens: int) -> float:
        """All the all-reduces of one step (0 on a single GPU)."""
        if not self._ar_count or not tokens:
            return 0.0
        return self._ar_count * self.one_allreduce(tokens * self._ar_bytes_per_token)

    def duration(self, tokens: int, seqs: int, prefill_ctx: float, decode_kv_tokens: int,
                 prefill_tokens: int | None = None) -> float:
        """Seconds for a batch of ``tokens`` new tokens from ``seqs`` sequences.

        ``prefill_ctx`` is the sum over prefill tokens of the context each attends to (itself
        included); ``decode_kv_tokens`` the sum of the decode sequences' contexts;
        ``prefill_tokens`` how many of ``tokens`` are prefill tokens (a gap profile's prefill
        attention efficiency depends on their mean context; None counts all ``tokens``; the
        plain model ignores it).
        """
        if tokens <= 0:
            return 0.0
        if self._gap:
            return self._gap_duration(tokens, seqs, prefill_ctx, decode_kv_tokens, prefill_tokens)
        # linear(tokens, seqs) and allreduce(tokens) inlined, operation for operation
        compute = 2.0 * (self.matmul_params * tokens + self.lm_head_params * seqs) / self._flops_rate
        p = self._p
        if p >= 64:
            memory = self._memory
            lin = compute if compute > memory else memory
        else:
            lin = (compute**p + self._memory_p) ** self._inv_p
        ar = (self._ar_count * (self._ar_latency + tokens * self._ar_bytes_per_token / self._ar_bw)
              if self._ar_count else 0.0)
        return (self._overhead + lin
                + prefill_ctx * self._attn_flops_per_ctx / self._attn_rate
                + decode_kv_tokens * self._kv_bytes / self._kv_rate
                + ar)


    def _gap_duration(self, tokens: int, seqs: int, prefill_ctx: float, decode_kv_tokens: int,
                      prefill_tokens: int | None) -> float:
        """:meth:`duration` for a gap profile: efficiency rising with the step's tokens, prefill
        attention slowing at long contexts, CPU per sequence (GPU speed is in the rates)."""
        compute = 2.0 * (self.matmul_params * tokens + self.lm_head_params * seqs) / self._flops_rate
        if self._half_tokens:
            compute *= (tokens + self._half_tokens) / tokens
        lin = (compute**self._p + self._memory_p) ** self._inv_p
        attn = prefill_ctx * self._attn_flops_per_ctx / self._attn_rate
        if self._ctx_knee and prefill_ctx:
            n = prefill_tokens if prefill_tokens else tokens
            attn *= math.sqrt(1.0 + prefill_ctx / max(1, n) / self._ctx_knee)
        ar = (self._ar_count * (self._ar_latency + tokens * self._ar_bytes_per_token / self._ar_bw)
              if self._ar_count else 0.0)
        return (self._overhead + seqs * self._seq_overhead + lin + attn
                + decode_kv_tokens * self._kv_bytes / self._kv_rate + ar)


def chunk_ctx(start: int, n: int) -> float:
    """Sum of contexts of ``n`` new tokens after ``start`` computed ones: n*start + n(n+1)/2."""
    return n * start + n * (n + 1) / 2.0

