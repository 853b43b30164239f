"""An upper bound on the TTFT-SLO attainment *any* policy could reach on a slice (issue 15).

Any placement, admission or order, on the same cluster and arrivals: a relaxation in which every
real schedule is feasible, so its optimum bounds the count of requests whose first token can come
within the SLO. It reads the sim engine's own step-time model (an offline analysis, not a
predictor: it never serves a decision). Three parts, each never above the truth:

* **Work** of a request's prefill on one instance (``prefill_work``): each computed token at the
  engine's best per-token efficiency (a full 8192-token step: the gap profile's efficiency rises
  with the step's tokens, and the step's fixed costs are spread over the most tokens), attention
  with the long-context slowdown at its floor (the most diluted step), plus the least a sampled
  sequence adds. Per token and additive, so batching cannot beat it: a step's duration is at least
  the sum of its tokens' shares (tests check this against the step timer). Tokens shared with an
  *earlier* request are free (unbounded cache): each block is paid by the first arrival holding
  it, and if a later arrival computed it first the work still lies in the first one's window.
* **Reachability** (``prefill_end``, ``handover_s``): the least time from arrival to first
  token. Blocks no earlier arrival holds were in no cache before the arrival, and whoever computes
  them (this request, or a later arrival with the same prefix) does so chunk after chunk in prefix
  order, each chunk's step lasting at least that chunk alone plus its attention in the densest
  step, however chunked (``prefill_wall``). Blocks shared with an earlier arrival count as cached
  from when their first holder could have computed them. Then the least hand-over:
  the KV pull on an idle link of what the decode instance could lack (any request arriving before
  the deadline may have left the prefix there), and one decode step. A request whose least TTFT
  exceeds the SLO is unreachable: x = 0.
* **Capacity** (``lp_bound``): time slots; x_i in [0, 1] the served fraction, y_it >= 0 its work
  in slot t, only in slots overlapping [arrival, deadline - least hand-over], sum_t y_it = work_i
  x_i, y_it <= its window's overlap with the slot (one instance at a time), sum_i y_it <= prefill
  instances x slot. Maximise sum x_i (pooled, preemptive and fractional: a superset of real
  schedules). Decode capacity and TBT are left out unless asked for, which only loosens the bound.
* **Decode** (optional, ``decode_work``): the same slot LP over the decode instances, sharing x_i.
  A request's tokens after the first are decode work (per token: a full step's share, a sample,
  and its context's KV read), done in [earliest first token, deadline + (output - 1) x TBT SLO]:
  with Mooncake's TBT (the mean of the slowest 10% of gaps) within the SLO, no gap outside them
  exceeds it, so the last token comes at most that long after the first. KV capacity, preemption
  and the engine's order are left out.

Engine noise multiplies each step by exp(N(0, sigma)): no hard floor exists, so every duration is
scaled by ``exp(-z sigma)`` (``noise_z`` standard deviations faster than the mean, on every step).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csr_matrix

from engines_adapters.sim.profiles import Profile
from engines_adapters.sim.timing import StepTimer

#: ``prefill_tokens`` that puts the long-context attention factor at its floor (1): the limit of a
#: step diluted by ever more short-context tokens
_DILUTED = 1 << 62


@dataclass(frozen=True)
class StepCosts:
    """The step timer decomposed into lower bounds (seconds, noise-free)."""

    budget: int  # tokens per step at most (max_num_batched_tokens)
    token_s: float  # non-attention time per token of a full step (fixed costs spread over it)
    ctx_s: float  # attention per unit of context, long-context factor at its floor
    sample_s: float  # the least one sampled sequence adds to a step
    chunk_s: float  # a lone chunk's non-attention time >= chunk_s + n x chunk_token_s (secant at the budget)
    chunk_token_s: float
    kv_s: float  # a decode token's read of one context token's KV
    timer: StepTimer

    def attention(self, ctx: float) -> float:
        """Attention of ``ctx`` context in the densest step (the budget's tokens all prefill)."""
        t = self.timer
        return t.duration(1, 0, ctx, 0, self.budget) - t.duration(1, 0, 0.0, 0, self.budget)


def engine_sigma(profile: Profile, noise: float) -> float:
    """The sim engine's per-step log-normal sigma (EngineModel: hypot of the cluster's noise and
    a gap profile's extra_noise; noise 0 turns it all off)."""
    return math.hypot(noise, profile.efficiency.get("extra_noise", 0.0)) if noise else 0.0


def step_costs(profile: Profile, budget: int = 8192) -> StepCosts:
    t = StepTimer(profile)
    d = t.duration
    x = 1e6
    return StepCosts(budget=budget, token_s=d(budget, 0, 0.0, 0, budget) / budget,
                     ctx_s=(d(1, 0, x, 0, _DILUTED) - d(1, 0, 0.0, 0, _DILUTED)) / x,
                     sample_s=min(d(n, 1, 0.0, 0, n) - d(n, 0, 0.0, 0, n) for n in range(1, budget + 1)),
                     chunk_s=d(budget, 0, 0.0, 0, budget) - budget * (d(budget, 0, 0.0, 0, budget)
                                                                      - d(budget - 1, 0, 0.0, 0, budget - 1)),
                     chunk_token_s=d(budget, 0, 0.0, 0, budget) - d(budget - 1, 0, 0.0, 0, budget - 1),
                     kv_s=(d(1, 0, 0.0, int(x), 1) - d(1, 0, 0.0, 0, 1)) / x, timer=t)


def ctx_sum(prompt: int, cached: int) -> float:
    """Sum of the contexts of tokens cached+1..prompt (each attends to itself and all before it)."""
    return (prompt * (prompt + 1) - cached * (cached + 1)) / 2.0


def prefill_work(c: StepCosts, prompt: int, cached: int) -> float:
    """Least instance time the prefill's own tokens take, within any batch."""
    n = prompt - cached
    return n * c.token_s + c.ctx_s * ctx_sum(prompt, cached) + c.sample_s


def decode_work(c: StepCosts, prompt: int, output: int) -> float:
    """Least decode-instance time of the ``output - 1`` tokens after the first: each a full step's
    per-token share plus a sampled sequence's, and its context's KV read (prompt + the tokens up to
    it). Additive, so no batch beats it: a decode step is the sum of its tokens' shares and more."""
    n = max(0, output - 1)
    return n * (c.token_s + c.sample_s) + c.kv_s * (n * prompt + n * (n + 1) / 2.0)


def prefill_wall(c: StepCosts, prompt: int, cached: int) -> float:
    """Least time from the prefill's first step to its last step's end: m chunks of at most the
    budget each cost a lone chunk's non-attention time (convex in its tokens: above the secant)
    plus their attention in the densest step (convex in the context: Jensen gives m equal shares);
    the least over m."""
    n = prompt - cached
    if n <= 0:
        return c.sample_s
    x = ctx_sum(prompt, cached)
    m = -(-n // c.budget)
    best = math.inf
    while m <= n:
        v = m * c.chunk_s + n * c.chunk_token_s + m * c.attention(x / m)
        if v >= best:  # convex in m: the first rise is past the minimum
            break
        best, m = v, m + 1
    return best + c.sample_s


def handover_s(c: StepCosts, profile: Profile, prompt: int, on_decode: int, net_bytes_per_s: float,
               noise: float = 1.0) -> float:
    """Least time from the prefill's end to the first token: the KV the decode instance lacks over an
    idle link, then the decode step computing the prompt's last token and sampling it."""
    transfer = (profile.efficiency.get("transfer_latency_ms", 1.0) * 1e-3
                + max(0, prompt - on_decode) * profile.kv_bytes_per_token / net_bytes_per_s)
    step = c.timer.duration(1, 0, 0.0, 0, 1) + c.attention(float(prompt)) + c.sample_s
    return transfer + noise * step


def shared_prefixes(hashes: list[list[int]], arrivals: list[float],
                    deadlines: list[float]) -> tuple[list[int], list[int], list[list[tuple[int, int]]]]:
    """Per request: leading blocks shared with an earlier arrival; leading blocks shared with any
    other request arriving before its deadline; and the first (earliest) holder of each of the
    former, run-length encoded as (end block, holder). Hashes are chained, so a shared block means
    a shared prefix up to it."""
    first: dict[int, tuple[float, int]] = {}  # block -> the two earliest (arrival, request) holding it
    second: dict[int, tuple[float, int]] = {}
    for i, hs in enumerate(hashes):
        for h in hs:
            e = (arrivals[i], i)
            f = first.get(h)
            if f is None or e < f:
                if f is not None:
                    second[h] = f
                first[h] = e
            elif h not in second or e < second[h]:
                second[h] = e
    earlier, window, holders = [], [], []
    for i, hs in enumerate(hashes):
        k = 0
        runs: list[tuple[int, int]] = []
        while k < len(hs) and first[hs[k]][1] != i:
            j = first[hs[k]][1]
            if runs and runs[-1][1] == j:
                runs[-1] = (k + 1, j)
            else:
                runs.append((k + 1, j))
            k += 1
        earlier.append(k)
        holders.append(runs)
        k = 0
        while k < len(hs):
            f = first[hs[k]]
            o = f if f[1] != i else second.get(hs[k])
            if o is None or o[0] >= deadlines[i]:
                break
            k += 1
        window.append(k)
    return earlier, window, holders


def prefill_end(c: StepCosts, i: int, prompts: list[int], arrivals: list[float], earlier: list[int],
                holders: list[list[tuple[int, int]]], block_size: int, speed: float = 1.0, grain: int = 32) -> float:
    """Least end time of request i's prefill. With m blocks cached when it starts its own chunks,
    it ends at least max(arrival, when block m-1 can first be cached) + its own wall time from m
    blocks on. Block m-1 was first held by h (no earlier arrival holds it): it and the blocks
    from h's own earlier-shared prefix up to it are computed in order after h arrives. Taken over
    every m, ``grain`` blocks at a time at each range's most favourable ends (within one holder's
    run the first time rises with m and the second falls), so the minimum is never overshot."""
    bs, p = block_size, prompts[i]
    best = arrivals[i] + speed * prefill_wall(c, p, 0)
    cap = (p - 1) // bs  # the engine computes one token at least
    start = 0
    for end, h in holders[i]:
        lo, hi = start + 1, min(end, cap)
        start = end
        for m1 in range(lo, hi + 1, grain):
            ready = max(arrivals[i], arrivals[h] + speed * (prefill_wall(c, m1 * bs, earlier[h] * bs) - c.sample_s))
            if ready >= best:  # later m in this run are cached later still
                break
            best = min(best, ready + speed * prefill_wall(c, p, min(hi, m1 + grain - 1) * bs))
    return best


#: one pool of the slot LP: (window starts, window ends, work per request, instances)
Pool = tuple[np.ndarray, np.ndarray, np.ndarray, int]


def lp_bound(arrivals: np.ndarray, ends: np.ndarray, work: np.ndarray, instances: int, slot_s: float,
             decode: Pool | None = None) -> dict[str, Any]:
    """max sum x_i over the slot LP of the module docstring. ``ends``: the latest prefill end
    (deadline - least hand-over); a request with ``ends <= arrivals`` or infinite work gets x = 0.
    ``decode``: a second pool (its own windows, work and instances) every served request also
    needs, in the same proportion x_i."""
    n = len(arrivals)
    pools: list[Pool] = [(arrivals, ends, work, instances)] + ([decode] if decode is not None else [])
    t0 = float(arrivals.min()) if n else 0.0
    ok = np.ones(n, dtype=bool)
    for starts, e, w, _ in pools:
        ok &= (e > starts) & np.isfinite(w)
    eq_r, eq_c, eq_v, ub_r, ub_c, caps, ys_hi = [], [], [], [], [], [], []
    ny = slots_before = 0
    for p, (starts, e, w, inst) in enumerate(pools):
        lo = np.floor((starts - t0) / slot_s).astype(np.int64)
        hi = np.where(ok, np.ceil((e - t0) / slot_s).astype(np.int64), lo)  # slots lo..hi-1 overlap the window
        counts = np.maximum(hi - lo, 0)
        m = int(counts.sum())
        slots = int(hi.max()) if n else 0
        owner = np.repeat(np.arange(n), counts)
        slot = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True)]) if m else np.zeros(0, np.int64)
        y = n + ny + np.arange(m)
        # equality (row p*n + i): sum_t y_it - work_i x_i = 0
        eq_r += [p * n + owner, p * n + np.arange(n)]
        eq_c += [y, np.arange(n)]
        eq_v += [np.ones(m), -np.where(ok, w, 0.0)]
        ub_r.append(slots_before + slot)
        ub_c.append(y)
        caps.append(np.full(slots, inst * slot_s))
        # a request works in a slot at most while its window overlaps it (one instance at a time)
        overlap = (np.minimum(t0 + (slot + 1) * slot_s, e[owner]) - np.maximum(t0 + slot * slot_s, starts[owner])
                   if m else np.zeros(0))
        ys_hi.append(np.clip(overlap, 0.0, slot_s))
        ny += m
        slots_before += slots
    a_eq = csr_matrix((np.concatenate(eq_v), (np.concatenate(eq_r), np.concatenate(eq_c))),
                      shape=(n * len(pools), n + ny))
    a_ub = csr_matrix((np.ones(ny), (np.concatenate(ub_r), np.concatenate(ub_c))), shape=(slots_before, n + ny))
    bounds = np.column_stack([np.zeros(n + ny), np.concatenate([ok.astype(float), *ys_hi])])
    t = time.perf_counter()
    res = linprog(np.concatenate([-np.ones(n), np.zeros(ny)]), A_ub=a_ub, b_ub=np.concatenate(caps),
                  A_eq=a_eq, b_eq=np.zeros(n * len(pools)), bounds=bounds, method="highs")
    solve_s = time.perf_counter() - t
    if res.status != 0:
        raise RuntimeError(f"the bound's LP failed: {res.message}")
    return {"optimum": -float(res.fun), "x": res.x[:n], "variables": n + ny,
            "constraints": n * len(pools) + slots_before, "slots": slots_before, "solve_s": solve_s}


def attainment_bound(arrivals: list[float], blocks: list[tuple[int, list[int]]], profile: Profile, *, prefill: int,
                     ttft_s: float, block_size: int = 16, budget: int = 8192, noise_sigma: float = 0.0,
                     noise_z: float = 0.0, slots_per_slo: int = 20, decode: int = 0,
                     outputs: list[int] | None = None, tbt_s: float | None = None) -> dict[str, Any]:
    """The bound for requests arriving at ``arrivals`` with prompts ``blocks`` (``list(reuse.prompt_blocks(...))``)
    on ``prefill`` instances of ``profile``; ``x``: the LP's served fraction per request. With
    ``decode`` instances, ``outputs`` (tokens per request) and the TBT SLO ``tbt_s``, it bounds the
    attainment of both SLOs: the decode pool joins the LP."""
    if decode and (outputs is None or tbt_s is None or len(outputs) != len(blocks)):
        raise ValueError("a decode pool needs every request's output tokens and the TBT SLO")
    c = step_costs(profile, budget)
    f = math.exp(-noise_z * noise_sigma)  # every step this much faster than its mean, at best
    net = profile.net_bytes_per_s * profile.efficiency.get("net_efficiency", 1.0)
    prompts = [p for p, _ in blocks]
    arr = np.asarray(arrivals, dtype=float)
    deadlines = arr + ttft_s
    earlier, window, holders = shared_prefixes([h for _, h in blocks], list(arr), list(deadlines))
    work, ends, least = [], [], []
    times = [float(t) for t in arr]
    for i, p in enumerate(prompts):
        h = handover_s(c, profile, p, window[i] * block_size, net, f)
        least.append(prefill_end(c, i, prompts, times, earlier, holders, block_size, f) - times[i] + h)
        ends.append(deadlines[i] - h)
        refused = p + 1 > profile.max_model_len  # the engine answers 400
        work.append(math.inf if refused or least[-1] > ttft_s else f * prefill_work(c, p, earlier[i] * block_size))
    pool = None
    if decode:
        assert outputs is not None and tbt_s is not None
        # after the first token (at least least_ttft after arrival, at most at the deadline) every
        # gap but the slowest 10% is at most their mean (<= the TBT SLO): the last token is at most
        # (output - 1) x SLO after the first
        out = np.asarray(outputs, dtype=float)
        pool = (arr + np.minimum(np.array(least), ttft_s), deadlines + np.maximum(out - 1, 0) * tbt_s,
                np.array([f * decode_work(c, p, o) for p, o in zip(prompts, outputs, strict=True)]), decode)
    lp = lp_bound(arr, np.array(ends), np.array(work), prefill, ttft_s / slots_per_slo, decode=pool)
    n = len(prompts)
    unreachable = sum(not math.isfinite(w) for w in work)
    return {"requests": n, "ttft_s": ttft_s, "noise_z": noise_z, "noise_factor": f, "unreachable": unreachable,
            "reachable_bound": (n - unreachable) / n if n else None,
            "attainment_bound": lp["optimum"] / n if n else None,
            "work_s": float(sum(w for w in work if math.isfinite(w))), "capacity_s": prefill * (
                float(arr.max() - arr.min()) + ttft_s) if n else 0.0,
            "lp": {k: v for k, v in lp.items() if k != "x"}, "x": lp["x"], "least_ttft_s": least}
