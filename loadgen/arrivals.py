"""Arrival processes and load scaling: compress a trace's time, or replace its arrivals.

Gamma inter-arrival gaps with coefficient of variation ``cv`` model burstiness (vLLM's
``--burstiness`` is 1/cv²): cv = 1 is Poisson, cv > 1 burstier, cv < 1 smoother. Replacing
arrivals keeps the request order (so a conversation's turns stay in order).
"""
from __future__ import annotations

import random
from dataclasses import replace

from .workload import Request, Workload

PROCESSES = ("poisson", "gamma")


def arrival_times(n: int, rate: float, process: str = "poisson", cv: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` arrival times (seconds, the first at 0) at a mean ``rate`` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if process not in PROCESSES:
        raise ValueError(f"unknown arrival process {process!r}; expected one of {', '.join(PROCESSES)}")
    if process == "gamma" and cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    rng = random.Random(seed)
    if process == "poisson" or cv == 1.0:
        gap = lambda: rng.expovariate(rate)  # noqa: E731
    else:
        shape = 1.0 / (cv * cv)
        gap = lambda: rng.gammavariate(shape, 1.0 / (rate * shape))  # noqa: E731
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += gap()
        out.append(t)
    return out


def sped_up(w: Workload, speedup: float) -> Workload:
    """The same requests with trace time divided by ``speedup``."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    return replace(w, requests=[replace(r, arrival_s=r.arrival_s / speedup) for r in w.requests])


def retimed(w: Workload, rate: float, process: str = "poisson", cv: float = 1.0, seed: int = 0) -> Workload:
    """The same requests, in the same order, arriving by a new process at ``rate`` per second."""
    times = arrival_times(len(w.requests), rate, process, cv, seed)
    return replace(w, requests=[replace(r, arrival_s=t) for r, t in zip(w.requests, times, strict=True)])


def rate_of(requests: list[Request]) -> float:
    """Offered rate: requests per second over the arrival span (0 for fewer than 2)."""
    if len(requests) < 2:
        return 0.0
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span if span > 0 else float("inf")
