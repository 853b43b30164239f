"""Telemetry generated from known per-term weights (what calibration must recover)."""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable

from predictors.facts import load_deployment
from predictors.learned_features import load_features, physics, prefill_features, tbt_features, transfer_features
from predictors.telemetry import RequestRecord
from predictors.types import Tier

DEPLOYMENT = "llama3-8b-h200"
#: Known weights: inverse efficiencies and fixed costs in each feature's units.
TRUE = {"prefill": (1.6, 1.9, 2.2, 0.4), "tbt": (1.5, 1.4, 3.0, 0.6, 2.0), "transfer": (0.004, 1.8),
        "store": (0.002, 2.5, 1.3)}


def synth_records(n: int, seed: int = 0, noise: float = 0.0, max_prompt: int = 16_000,
                  prefill_truth: Callable[[int, int], float] | None = None,
                  deployment: str = DEPLOYMENT, store_share: float = 0.0,
                  cluster_of: Callable[[float], float] | None = None, full_share: float = 0.0) -> list[RequestRecord]:
    """``n`` requests on one prefill and one decode instance, each finding the prefill instance
    idle; every term's time is its true weights times its features (or ``prefill_truth``), times
    lognormal noise of sigma ``noise``. A ``store_share`` of them load part of their cached prefix
    from the shared store first (its time, ``TRUE["store"]`` over the load features, inside the leg),
    half of those while the store's links were busy with write-through (``store_busy_s``).
    ``cluster_of(i / n)``: the cluster's decode load of request i (default: uniform 0-40).
    ``full_share`` of them join a decode cache reserved past its capacity whose sequences share
    prefix blocks (a ``decode_kv_share`` of 0.3-1): their step reads capacity / share of context,
    computed here from a roofline of that capacity, not through the features' own share."""
    rng = random.Random(seed)
    load_rng = random.Random(~seed)  # its own stream: the other draws stay what they were
    share_rng = random.Random(seed + 7919)
    d = load_deployment(deployment)
    r = physics(d)
    ts = d.time_scale

    def jitter() -> float:
        return math.exp(rng.gauss(0.0, noise)) if noise else 1.0

    def dot(w: tuple[float, ...], x: list[float]) -> float:
        return sum(a * b for a, b in zip(w, x, strict=True))

    out = []
    t = 0.0
    for i in range(n):
        prompt = int(math.exp(rng.uniform(math.log(64), math.log(max_prompt))))
        cached = rng.choice((0, 0, prompt // 2, (prompt * 9) // 10)) // 16 * 16
        running, kv = rng.randrange(0, 64), rng.randrange(0, 200_000)
        max_tokens = rng.randrange(16, 400)
        cluster = load_rng.uniform(0.0, 40.0)  # the cluster's decode load at decision
        if cluster_of is not None:
            cluster = cluster_of(i / n)
        pre = (prefill_truth(prompt, cached) if prefill_truth else
               dot(TRUE["prefill"], prefill_features(r, ts, prompt, cached))) * jitter()
        share = 1.0
        if full_share and share_rng.random() < full_share:
            share, kv = share_rng.uniform(0.3, 1.0), share_rng.randrange(r.kv_capacity_tokens, 4 * r.kv_capacity_tokens)
        held = dataclasses.replace(r, kv_capacity_tokens=int(r.kv_capacity_tokens / share))
        tbt = dot(TRUE["tbt"], tbt_features(held, ts, running, kv, prompt, max_tokens, cluster))
        stored = cached // 2 // 16 * 16 if cached and rng.random() < store_share else 0
        busy = rng.uniform(0.0, 0.3) * ts if stored and rng.random() < 0.5 else 0.0
        if stored:
            pre += dot(TRUE["store"], load_features(r, ts, Tier.STORE, stored, busy_s=busy)) * jitter()
        bw = d.net_bytes_per_s
        xfer = dot(TRUE["transfer"], transfer_features(r, ts, prompt, bw)) * jitter()
        rec = RequestRecord(f"r{i}", arrival_s=t, prompt_tokens=prompt, max_tokens=max_tokens, status="ok",
                            policy="conductor", decided_s=t, prefill_instance="p-1", decode_instance="d-1",
                            hit_tokens=cached, local_hit_tokens=cached, decode_running=running, decode_kv_tokens=kv,
                            decode_cluster_running=cluster, decode_kv_share=share,
                            predicted_decode_wait_s=0.0, prefill_deployment=deployment, decode_deployment=deployment,
                            sent_s=t, prefill_start_s=t, prefill_end_s=t + pre, transfer_tokens=stored,
                            transfer_from=Tier.STORE if stored else None, store_busy_s=busy)
        first = t + pre + xfer + tbt
        rec.decode_start_s = t + pre
        rec.first_token_s = first
        times = [first]
        for _ in range(max_tokens - 1):
            times.append(times[-1] + tbt * jitter())
        rec.token_times = times
        rec.output_tokens = max_tokens
        rec.end_s = rec.token_times[-1]
        out.append(rec)
        t = rec.prefill_end_s + 0.01 + rng.random() * 0.05  # the next request finds the instance idle
    return out
