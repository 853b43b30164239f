"""Two tenants sharing a system prompt, under ``cache = "shared"`` and ``cache = "isolated"``:
prefix-cache hit ratio and TTFT side by side (issue 14). A short live run: ``conductor serve``
with its embedded simulated cluster on loopback, two API keys, streamed completions.

    .venv/bin/python bench/experiments/tenants.py [--requests 40] [--rate 4] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.servers import conductor, free_port, stop, wait_until  # noqa: E402

CONFIG = """
[embedded]
prefill = 2
decode = 2
seed = 1
[auth]
admin_token = "adm"
cache_salt_secret = "experiment-secret"
[auth.api_keys.tenant-a]
key = "key-a"
cache = "{mode}"
[auth.api_keys.tenant-b]
key = "key-b"
cache = "{mode}"
"""


def system_prompt(chars: int) -> str:
    rng = random.Random(5)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(chars))


async def one(session: aiohttp.ClientSession, url: str, key: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = usage = None
    async with session.post(url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        cached = int(r.headers.get("x-conductor-prefill-cached-tokens", "0"))
        predicted = int(r.headers["x-conductor-hit-tokens"])
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"], "cached": cached, "predicted": predicted}


async def run_mode(mode: str, n: int, rate: float, sys_chars: int) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "conductor.toml")
        Path(cfg).write_text(CONFIG.format(mode=mode))
        proc: subprocess.Popen = conductor("serve", "--config", cfg, "--port", str(port), "--log-level", "warning")
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until(url + "/ready", proc, timeout_s=90)
            shared = system_prompt(sys_chars)
            rng = random.Random(9)
            async with aiohttp.ClientSession() as s:
                models = await (await s.get(url + "/v1/models", headers={"authorization": "Bearer key-a"})).json()
                model = models["data"][0]["id"]
                tasks = []
                for i in range(2 * n):  # alternate the tenants, Poisson arrivals at `rate` a second
                    tenant, key = ("a", "key-a") if i % 2 == 0 else ("b", "key-b")
                    question = " ".join(rng.choice(["why", "how", "when", "where", "who", "list", "explain"])
                                        for _ in range(20))
                    tasks.append((tenant, asyncio.create_task(one(s, url, key, model, f"{shared}\nQ{i}: {question}"))))
                    await asyncio.sleep(rng.expovariate(rate))
                results = {"a": [], "b": []}
                for tenant, t in tasks:
                    results[tenant].append(await t)
        finally:
            stop(proc)
    out = {}
    for tenant, rs in results.items():
        ttfts = sorted(r["ttft_s"] for r in rs)
        out[tenant] = {
            "requests": len(rs),
            "hit_ratio": sum(r["cached"] for r in rs) / sum(r["prompt_tokens"] for r in rs),
            "predicted_hit_ratio": sum(r["predicted"] for r in rs) / sum(r["prompt_tokens"] for r in rs),
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            # what the side channel reads: the tenant's first request, after the other tenant's
            "first_cached": rs[0]["cached"], "first_prompt_tokens": rs[0]["prompt_tokens"],
            "first_ttft_s": rs[0]["ttft_s"],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40, help="requests per tenant and mode")
    p.add_argument("--rate", type=float, default=4.0, help="arrivals a second, both tenants together")
    p.add_argument("--system-chars", type=int, default=6000, help="shared system prompt length (byte tokens)")
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args()
    res = {mode: asyncio.run(run_mode(mode, a.requests, a.rate, a.system_chars)) for mode in ("shared", "isolated")}
    print("| cache mode | tenant | requests | hit ratio (served) | hit ratio (predicted) | TTFT mean (ms) | "
          "TTFT p50 (ms) | TTFT p90 (ms) | first request: cached / prompt tokens | first request TTFT (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, per in res.items():
        for tenant, r in per.items():
            print(f"| {mode} | {tenant} | {r['requests']} | {100 * r['hit_ratio']:.1f}% | "
                  f"{100 * r['predicted_hit_ratio']:.1f}% | {1e3 * r['ttft_mean_s']:.1f} | "
                  f"{1e3 * r['ttft_p50_s']:.1f} | {1e3 * r['ttft_p90_s']:.1f} | "
                  f"{r['first_cached']} / {r['first_prompt_tokens']} | {1e3 * r['first_ttft_s']:.1f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
