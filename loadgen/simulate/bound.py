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
  *earlier* request are free (unbounded cache), costed two ways, each a relaxation; the bound is
  the lower optimum. *First holder*: each block is paid by the first arrival holding it, in its
  window, in proportion to its own x (if a later arrival computed it first, that was still within
  the first one's window if the first was served). *Paid once* (``shared_segments``): a block is
  computed at least once if any request holding it is served, by whoever, between its first
  holder's arrival and the last such request's window end; a holder's first-held tokens are cut
  into segments where later requests' shared prefixes end, each segment a job of its own with
  x_i <= z_segment for every request needing it. The first is the looser where a refused
  request's prefix feeds served ones (their prefix costs no one anything); the second where one
  prefix feeds many (its window spans all of theirs).
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


@dataclass(frozen=True)
class Segments:
    """Shared prefix work paid once (``shared_segments``): each segment a job of the prefill pool with
    its own window and work, its served fraction z; a request is served no more than each segment
    it needs (``needs``: (request, segment)), and a chain's later segment no more than the one
    before it (``chain``: (segment, previous segment))."""

    starts: np.ndarray
    ends: np.ndarray
    work: np.ndarray
    needs: np.ndarray  # (k, 2) int
    chain: np.ndarray  # (k, 2) int


def lp_bound(arrivals: np.ndarray, ends: np.ndarray, work: np.ndarray, instances: int, slot_s: float,
             decode: Pool | None = None, shared: Segments | None = None) -> dict[str, Any]:
    """max sum x_i over the slot LP of the module docstring. ``ends``: the latest prefill end
    (deadline - least hand-over); a request with ``ends <= arrivals`` or infinite work gets x = 0.
    ``decode``: a second pool (its own windows, work and instances) every served request also
    needs, in the same proportion x_i. ``shared``: segments of prefill work (their own served
    fractions, after the requests' in x) that requests need."""
    n = len(arrivals)
    if shared is None:
        none = np.zeros(0)
        shared = Segments(none, none, none, np.zeros((0, 2), np.int64), np.zeros((0, 2), np.int64))
    s = len(shared.starts)
    jobs = n + s
    empty = np.zeros(s)
    # per pool: (starts, ends, work, instances, member); segments are prefill work only
    pools = [(np.concatenate([arrivals, shared.starts]), np.concatenate([ends, shared.ends]),
              np.concatenate([work, shared.work]), instances, np.ones(jobs, dtype=bool))]
    if decode is not None:
        d0, d1, dw, di = decode
        pools.append((np.concatenate([d0, empty]), np.concatenate([d1, empty]), np.concatenate([dw, empty]), di,
                      np.arange(jobs) < n))
    t0 = float(arrivals.min()) if n else 0.0
    ok = np.ones(jobs, dtype=bool)
    for starts, e, w, _, member in pools:
        ok &= ~member | ((e > starts) & np.isfinite(w))
    eq_r, eq_c, eq_v, ub_r, ub_c, caps, ys_hi = [], [], [], [], [], [], []
    ny = slots_before = 0
    for p, (starts, e, w, inst, member) in enumerate(pools):
        lo = np.floor((starts - t0) / slot_s).astype(np.int64)
        # slots lo..hi-1 overlap the window
        hi = np.where(ok & member, np.ceil((e - t0) / slot_s).astype(np.int64), lo)
        counts = np.maximum(hi - lo, 0)
        m = int(counts.sum())
        slots = int(hi.max()) if jobs else 0
        owner = np.repeat(np.arange(jobs), counts)
        slot = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True)]) if m else np.zeros(0, np.int64)
        y = jobs + ny + np.arange(m)
        # equality (row p*jobs + j): sum_t y_jt - work_j x_j = 0
        eq_r += [p * jobs + owner, p * jobs + np.arange(jobs)]
        eq_c += [y, np.arange(jobs)]
        eq_v += [np.ones(m), -np.where(ok & member, w, 0.0)]
        ub_r.append(slots_before + slot)
        ub_c.append(y)
        caps.append(np.full(slots, inst * slot_s))
        # a job works in a slot at most while its window overlaps it (one instance at a time)
        overlap = (np.minimum(t0 + (slot + 1) * slot_s, e[owner]) - np.maximum(t0 + slot * slot_s, starts[owner])
                   if m else np.zeros(0))
        ys_hi.append(np.clip(overlap, 0.0, slot_s))
        ny += m
        slots_before += slots
    a_eq = csr_matrix((np.concatenate(eq_v), (np.concatenate(eq_r), np.concatenate(eq_c))),
                      shape=(jobs * len(pools), jobs + ny))
    # x_i - z_k <= 0 (a request needs its segments), z_k - z_prev <= 0 (a chain is needed as a prefix)
    pairs = np.concatenate([np.column_stack([shared.needs[:, 0], n + shared.needs[:, 1]]),
                            n + shared.chain]).reshape(-1, 2).astype(np.int64)
    links = len(pairs)
    r = slots_before + np.arange(links)
    a_ub = csr_matrix((np.concatenate([np.ones(ny), np.ones(links), -np.ones(links)]),
                       (np.concatenate([*ub_r, r, r]), np.concatenate([*ub_c, pairs[:, 0], pairs[:, 1]]))),
                      shape=(slots_before + links, jobs + ny))
    bounds = np.column_stack([np.zeros(jobs + ny), np.concatenate([ok.astype(float), *ys_hi])])
    t = time.perf_counter()
    res = linprog(np.concatenate([-np.ones(n), np.zeros(s + ny)]), A_ub=a_ub,
                  b_ub=np.concatenate([*caps, np.zeros(links)]),
                  A_eq=a_eq, b_eq=np.zeros(jobs * len(pools)), bounds=bounds, method="highs")
    solve_s = time.perf_counter() - t
    if res.status != 0:
        raise RuntimeError(f"the bound's LP failed: {res.message}")
    return {"optimum": -float(res.fun), "x": res.x[:n], "variables": jobs + ny,
            "constraints": jobs * len(pools) + slots_before + links, "slots": slots_before, "solve_s": solve_s}


def shared_segments(prompts: list[int], earlier: list[int], holders: list[list[tuple[int, int]]],
                    block_size: int) -> tuple[list[int], list[tuple[int, int, int]], list[tuple[int, int]],
                                                list[tuple[int, int]]]:
    """Cut each request's first-held tokens (from its earlier-shared prefix on) where a later
    request's shared prefix ends. Returns each request's private start (the tokens from it on are
    its own work), the segments (holder, first token, end token), the needs (request, last
    segment it needs of a holder's chain) and the chain links (segment, the one before it)."""
    cuts: list[set[int]] = [set() for _ in prompts]
    for runs in holders:
        for end, h in runs:
            cuts[h].add(end * block_size)
    segments: list[tuple[int, int, int]] = []
    last: dict[tuple[int, int], int] = {}  # (holder, end token) -> the segment ending there
    chain: list[tuple[int, int]] = []
    private = []
    for h, cs in enumerate(cuts):
        lo = earlier[h] * block_size
        for k, cut in enumerate(sorted(cs)):
            assert cut > lo, "a later request shares a holder's first-held blocks from their start"
            if k:
                chain.append((len(segments), len(segments) - 1))
            last[(h, cut)] = len(segments)
            segments.append((h, lo, cut))
            lo = cut
        private.append(lo)
    needs = [(i, last[(h, end * block_size)]) for i, runs in enumerate(holders) for end, h in runs]
    needs += [(h, last[(h, max(cs))]) for h, cs in enumerate(cuts) if cs]
    return private, segments, needs, chain


def attainment_bound(arrivals: list[float], blocks: list[tuple[int, list[int]]], profile: Profile, *, prefill: int,
                     ttft_s: float, block_size: int = 16, budget: int = 8192, noise_sigma: float = 0.0,
                     noise_z: float = 0.0, slots_per_slo: int = 20, decode: int = 0,
                     outputs: list[int] | None = None, tbt_s: float | None = None) -> dict[str, Any]:
    """The bound for requests arriving at ``arrivals`` with prompts ``blocks`` (``list(reuse.prompt_blocks(...))``)
    on ``prefill`` instances of ``profile``; ``x``: the LP's served fraction per request. With
    ``decode`` instances, ``outputs`` (tokens per request) and the TBT SLO ``tbt_s``, it bounds the
    attainment of both SLOs: the decode pool joins the LP. Shared prefixes are costed both ways of
    the module docstring (``accounting``: each LP's optimum / n); the bound is the lower."""
    if decode and (outputs is None or tbt_s is None or len(outputs) != len(blocks)):
        raise ValueError("a decode pool needs every request's output tokens and the TBT SLO")
    c = step_costs(profile, budget)
    f = math.exp(-noise_z * noise_sigma)  # every step this much faster than its mean, at best
    net = profile.net_bytes_per_s * profile.efficiency.get("net_efficiency", 1.0)
    prompts = [p for p, _ in blocks]
    arr = np.asarray(arrivals, dtype=float)
    deadlines = arr + ttft_s
    earlier, window, holders = shared_prefixes([h for _, h in blocks], list(arr), list(deadlines))
    own, segments, needs, chain = shared_segments(prompts, earlier, holders, block_size)
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
    e, w, slot = np.array(ends), np.array(work), ttft_s / slots_per_slo
    lps = {"first_holder": lp_bound(arr, e, w, prefill, slot, decode=pool)}
    if segments:  # the same requests' private work, their shared prefixes as segments
        mine = np.array([x if not math.isfinite(x) else f * prefill_work(c, p, o)
                         for x, p, o in zip(work, prompts, own, strict=True)])
        lps["paid_once"] = lp_bound(arr, e, mine, prefill, slot, decode=pool,
                                    shared=_segment_jobs(c, f, arr, e, w, segments, needs, chain))
    lp = min(lps.values(), key=lambda r: r["optimum"])
    n = len(prompts)
    unreachable = sum(not math.isfinite(w) for w in work)
    return {"requests": n, "ttft_s": ttft_s, "noise_z": noise_z, "noise_factor": f, "unreachable": unreachable,
            "reachable_bound": (n - unreachable) / n if n else None,
            "attainment_bound": lp["optimum"] / n if n else None,
            "accounting": {k: r["optimum"] / n for k, r in lps.items()} if n else {},
            "work_s": float(sum(w for w in work if math.isfinite(w))), "capacity_s": prefill * (
                float(arr.max() - arr.min()) + ttft_s) if n else 0.0,
            "lp": {**{k: v for k, v in lp.items() if k != "x"}, "solve_s": sum(r["solve_s"] for r in lps.values())},
            "x": lp["x"], "least_ttft_s": least}


def _segment_jobs(c: StepCosts, f: float, arr: np.ndarray, ends: np.ndarray, work: np.ndarray,
                  segments: list[tuple[int, int, int]], needs: list[tuple[int, int]],
                  chain: list[tuple[int, int]]) -> Segments:
    """The segments as LP jobs: from their holder's arrival (no one held the tokens before) to the
    last end of a reachable request needing them (whoever computes them, it is done by then)."""
    reach = np.isfinite(work) & (ends > arr)
    starts = np.array([arr[h] for h, _, _ in segments])
    last = np.full(len(segments), -math.inf)
    for i, k in needs:
        if reach[i]:
            last[k] = max(last[k], ends[i])
    for k, prev in reversed(chain):  # needing a segment needs every one before it in its chain
        last[prev] = max(last[prev], last[k])
    return Segments(starts=starts, ends=np.maximum(last, starts),
                    work=np.array([f * (prefill_work(c, hi, lo) - c.sample_s) for _, lo, hi in segments]),
                    needs=np.array(needs, dtype=np.int64).reshape(-1, 2),
                    chain=np.array(chain, dtype=np.int64).reshape(-1, 2))
