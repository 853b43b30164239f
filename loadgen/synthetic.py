"""Synthetic workloads: length distributions, Poisson/gamma arrivals, multi-turn conversations.

A conversation is one growing token stream: turn k's prompt is everything before it (a shared
system prefix, earlier user messages and answers) plus a new user message, so turn k+1 reuses
turn k's whole prompt as a prefix, the pattern Mooncake's conversation trace shows. The stream is
expressed as 512-token block ids exactly like a Mooncake trace (ids allocated densely in order of
first use), so the same prompt synthesis and the same reports apply; ``to_mooncake_jsonl`` writes
it out as a trace.

Turns are open loop too: turn k+1 arrives a think time after turn k *arrived* (never after its
answer), so a fast speed-up can send a turn before the previous answer is complete.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

from .arrivals import arrival_times
from .workload import TRACE_BLOCK_TOKENS, Request, Workload

DIST_KINDS = ("fixed", "uniform", "normal", "lognormal", "exp")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution; samples are integers clipped to [1, ``cap``]."""

    kind: str
    a: float
    b: float = 0.0
    cap: int = 1_000_000

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            v = self.a
        elif self.kind == "uniform":
            v = rng.uniform(self.a, self.b + 1)  # integers a..b inclusive after floor
        elif self.kind == "normal":
            v = rng.gauss(self.a, self.b)
        elif self.kind == "lognormal":
            v = self.a * math.exp(rng.gauss(0.0, self.b))  # a = median, b = sigma of log
        else:  # exp
            v = rng.expovariate(1.0 / self.a)
        return int(min(self.cap, max(1, math.floor(v))))

    def __str__(self) -> str:
        return {"fixed": f"{self.a:g}", "exp": f"exp:{self.a:g}"}.get(self.kind, f"{self.kind}:{self.a:g}:{self.b:g}")


def parse_dist(text: str) -> LengthDist:
    """``N`` | ``uniform:LO:HI`` | ``normal:MEAN:STD`` | ``lognormal:MEDIAN:SIGMA`` | ``exp:MEAN``."""
    parts = text.strip().split(":")
    try:
        nums = [float(p) for p in parts[1:]] if len(parts) > 1 else [float(parts[0])]
    except ValueError:
        raise ValueError(f"bad length distribution {text!r}; expected N, uniform:LO:HI, normal:MEAN:STD, "
                         "lognormal:MEDIAN:SIGMA or exp:MEAN") from None
    kind = "fixed" if len(parts) == 1 else parts[0]
    want = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}.get(kind)
    if want is None or len(nums) != want:
        raise ValueError(f"bad length distribution {text!r}; expected N, uniform:LO:HI, normal:MEAN:STD, "
                         "lognormal:MEDIAN:SIGMA or exp:MEAN")
    if nums[0] < 1 and kind != "normal" or (kind == "uniform" and nums[1] < nums[0]) or any(x < 0 for x in nums):
        raise ValueError(f"bad length distribution {text!r}: lengths must be >= 1 (and LO <= HI)")
    return LengthDist(kind, nums[0], nums[1] if len(nums) > 1 else 0.0)


def synthetic_workload(n_requests: int, rate: float, *, input_tokens: LengthDist, output_tokens: LengthDist,
                       process: str = "poisson", cv: float = 1.0, turns: int = 1, turn_gap_s: float = 10.0,
                       shared_prefix_blocks: int = 1, block_tokens: int = TRACE_BLOCK_TOKENS,
                       seed: int = 0) -> Workload:
    """``n_requests`` requests at a mean ``rate`` per second.

    Conversations start by the arrival process at ``rate / turns``; each has ``turns`` turns a
    think time apart (exponential, mean ``turn_gap_s``). Every prompt starts with
    ``shared_prefix_blocks`` blocks common to all (a system prompt; Mooncake's hash id 0), then
    the conversation's own stream. ``input_tokens`` is the new user text per turn.
    """
    if n_requests < 1 or turns < 1 or shared_prefix_blocks < 0:
        raise ValueError("need n_requests >= 1, turns >= 1, shared_prefix_blocks >= 0")
    rng = random.Random(seed)
    n_conv = math.ceil(n_requests / turns)
    starts = arrival_times(n_conv, rate / turns, process, cv, seed)
    ids: dict[tuple[int, int], int] = {}  # (conversation or -1 for shared, block) -> dense id

    def block_id(conv: int, j: int) -> int:
        key = (-1, j) if j < shared_prefix_blocks else (conv, j)
        return ids.setdefault(key, len(ids))

    shared = shared_prefix_blocks * block_tokens
    drafts: list[tuple[float, int, int, int, int]] = []  # arrival, conv, turn, input, output
    for c, t in enumerate(starts):
        context = shared
        for k in range(turns):
            if k:
                t += rng.expovariate(1.0 / turn_gap_s) if turn_gap_s > 0 else 0.0
            n_in = context + input_tokens.sample(rng)
            n_out = output_tokens.sample(rng)
            drafts.append((t, c, k, n_in, n_out))
            context = n_in + n_out  # the answer joins the next turn's context
    drafts.sort(key=lambda d: (d[0], d[1], d[2]))
    reqs = []
    for i, (t, c, k, n_in, n_out) in enumerate(drafts[:n_requests]):
        hash_ids = tuple(block_id(c, j) for j in range(math.ceil(n_in / block_tokens)))
        reqs.append(Request(i, t, n_in, n_out, hash_ids, conversation=c, turn=k))
    desc = (f"synthetic(n={n_requests}, rate={rate:g}/s, {process}{'' if process == 'poisson' else f' cv={cv:g}'}, "
            f"input={input_tokens}, output={output_tokens}, turns={turns}, "
            f"shared_prefix_blocks={shared_prefix_blocks}, seed={seed})")
    return Workload(reqs, desc, "synthetic", block_tokens)


def to_mooncake_jsonl(w: Workload, path: str) -> None:
    """Write a workload in Mooncake's trace format (timestamps in ms)."""
    with open(path, "w") as f:
        for r in w.requests:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000, 3), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
