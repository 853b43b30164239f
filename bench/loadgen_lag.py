"""Load generator client lag: how closely the open-loop runner keeps its send schedule.

Starts the fixed-latency target in its own process (TTFT 80 ms, 20 ms between tokens), replays
Poisson arrivals at a given rate against it, and prints one JSON line: send lag (actual minus
scheduled start) p50/p99/max, event-loop lag p99 and the client's CPU share of one core. These
are wall-clock figures of this machine, which is why they live here and not in the test suite.

    .venv/bin/python bench/loadgen_lag.py [--rate 50] [--requests 600] [--output-tokens 6]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loadgen.fixed_target import spawn  # noqa: E402
from loadgen.metrics import percentile  # noqa: E402
from loadgen.prompts import ENDPOINTS, PromptSynth, build_body  # noqa: E402
from loadgen.runner import RunnerOptions, Send, run_sends  # noqa: E402
from loadgen.workload import Request  # noqa: E402


def poisson_sends(n: int, rate: float, n_in: int, n_out: int, seed: int = 4) -> list[Send]:
    rng, t, synth, out = random.Random(seed), 0.0, PromptSynth(salt="lag"), []
    k = -(-n_in // 512)
    for i in range(n):
        r = Request(i, t, n_in, n_out, tuple(range(i * k, i * k + k)))
        body, n_prompt = build_body(r, synth, model="fixed-model", endpoint="chat", prompt_format="text")
        out.append(Send(r, json.dumps(body).encode(), n_prompt, f"r{i}"))
        t += rng.expovariate(rate)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--input-tokens", type=int, default=2000)
    ap.add_argument("--output-tokens", type=int, default=6)
    a = ap.parse_args()
    sends = poisson_sends(a.requests, a.rate, a.input_tokens, a.output_tokens)
    with spawn("--ttft-ms", "80", "--itl-ms", "20") as url:
        res = asyncio.run(run_sends(url, sends, RunnerOptions(path=ENDPOINTS["chat"])))
    ok = sum(r.status == "ok" for r in res.records)
    lags_ms = [x * 1e3 for x in res.send_lags_s]
    print(json.dumps({
        "bench": "loadgen_lag", "rate": a.rate, "requests": a.requests, "ok": ok,
        "send_lag_p50_ms": round(percentile(lags_ms, 50), 3), "send_lag_p99_ms": round(percentile(lags_ms, 99), 3),
        "send_lag_max_ms": round(max(lags_ms), 3),
        "loop_lag_p99_ms": round(percentile([x * 1e3 for x in res.loop_lags_s], 99), 3),
        "client_cpu_util": round(res.cpu_util, 3),
    }))


if __name__ == "__main__":
    main()
