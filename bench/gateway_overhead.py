"""Gateway overhead: streaming through `conductor serve` vs straight to the same sim engines.

Starts two `both` sim engines (``--topology pd``: two prefill/decode pairs) and a gateway in front
of them (all on loopback), then runs rounds that alternate direct and gateway traffic at the same
concurrency, so machine noise hits both. "Direct" to a PD pair is the bare protocol run from this
process with the project's own driver (vLLM's two-step, SGLang's dual dispatch with a bootstrap
room, or vLLM's MooncakeConnector with a transfer id): what any router must do, without the
gateway's hop, tokenizing and scheduling.
Prints one JSON line per engine family: added TTFT p50/p99 at low load (one stream at a time)
and the ratio of streamed tokens per second at high load (default 32 concurrent 64-token streams).

    .venv/bin/python bench/gateway_overhead.py [--topology both|pd] [--flavor vllm|sglang|vllm-mooncake|all]
        [--concurrency 32] [--tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engines_adapters.drivers import Pair, PairRequest, driver_for  # noqa: E402
from engines_adapters.engine_client import EngineClient  # noqa: E402
from engines_adapters.net import free_port  # noqa: E402
from gateway.embedded import stop_processes  # noqa: E402


class _NoHooks:
    """The direct path reports to nobody."""

    def prefill_started(self) -> None: ...
    def prefill_finished(self, cached_tokens: int | None = None) -> None: ...
    def handed_over(self) -> None: ...


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONHASHSEED": "0"})


async def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


async def one_stream(s: aiohttp.ClientSession, base: str | tuple, model: str, i: int,
                     tokens: int) -> tuple[float, int, float]:
    """One stream to a URL, or (``base`` = (flavor, prefill URL, decode URL, bootstrap port)) to a
    PD pair driven directly with that family's protocol."""
    body = {"model": model, "messages": [{"role": "user", "content": f"request {i} " + "x" * 200}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first, n = None, 0
    if isinstance(base, tuple):
        flavor, purl, durl, boot = base
        pair = Pair(EngineClient(s, "p", purl, flavor=flavor, bootstrap_port=boot), EngineClient(s, "d", durl))
        r = await driver_for(flavor).open(pair, PairRequest(f"direct-{i}", "/v1/chat/completions", body), _NoHooks())
    else:
        r = await s.post(base + "/v1/chat/completions", json=body)
    try:
        assert r.status == 200, await r.read()
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                n += 1
                if first is None:
                    first = time.perf_counter() - t0
    finally:
        r.close()
    return first or 0.0, n, time.perf_counter() - t0


async def run(base: str | tuple, model: str, concurrency: int, tokens: int, salt: int) -> tuple[list[float], float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_stream(s, base, model, salt * 1000 + i, tokens) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return [r[0] for r in res], sum(r[1] for r in res) / wall


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def engines(a, flavor: str) -> tuple[list[list[str]], list[str], list]:
    """(sim-engine argument lists, gateway config [[engines]] blocks, direct targets)."""
    from gateway.embedded import BOOTSTRAP_FLAGS, sim_flavor_args

    common = ["--time-scale", str(a.time_scale), *sim_flavor_args(flavor)]
    args, entries, direct = [], [], []
    for i in range(2):
        if a.topology == "both":
            p = free_port()
            args.append(["sim-engine", "--role", "both", "--port", str(p), *common])
            entries.append(f'[[engines]]\nid = "e{i}"\nrole = "both"\nkind = "sim"\nprotocol = "{flavor}"\n'
                           f'url = "http://127.0.0.1:{p}"\n')
            direct.append(f"http://127.0.0.1:{p}")
            continue
        pp, dp, boot = free_port(), free_port(), free_port()
        args.append(["sim-engine", "--role", "prefill", "--port", str(pp), *common])
        if flavor != "vllm":
            args[-1] += [BOOTSTRAP_FLAGS[flavor], str(boot)]
        args.append(["sim-engine", "--role", "decode", "--port", str(dp), *common])
        entries.append(f'[[engines]]\nid = "p{i}"\nrole = "prefill"\nkind = "sim"\nprotocol = "{flavor}"\n'
                       f'bootstrap_port = {boot}\nurl = "http://127.0.0.1:{pp}"\n')
        entries.append(f'[[engines]]\nid = "d{i}"\nrole = "decode"\nkind = "sim"\nprotocol = "{flavor}"\n'
                       f'url = "http://127.0.0.1:{dp}"\n')
        direct.append((flavor, f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}", boot))
    return args, entries, direct


async def main_async(a, flavor: str) -> dict:
    gw_port = free_port()
    argv, entries, direct = engines(a, flavor)
    procs = [start(x) for x in argv]
    try:
        for x in argv:
            await wait_http(f"http://127.0.0.1:{x[x.index('--port') + 1]}/health")
        cfg = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
        cfg.write("policy = \"round_robin\"\n[slo]\nttft_ms = 600000\ntbt_ms = 600000\n")
        cfg.write("".join(entries))
        cfg.close()
        procs.append(start(["serve", "--config", cfg.name, "--port", str(gw_port), "--log-level", "warning"]))
        gw = f"http://127.0.0.1:{gw_port}"
        await wait_http(gw + "/ready")
        async with aiohttp.ClientSession() as s:
            async with s.get(gw + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        ttft_d, ttft_g, tps_d, tps_g = [], [], [], []
        salt = 0
        for _ in range(a.rounds):  # interleaved rounds: noise hits both paths alike
            for _ in range(a.low_load_requests):
                salt += 1
                ttft_d += (await run(direct[salt % 2], model, 1, 8, salt))[0]
                salt += 1
                ttft_g += (await run(gw, model, 1, 8, salt))[0]
            half = a.concurrency // 2
            salt += 1
            d0, d1 = await asyncio.gather(run(direct[0], model, half, a.tokens, salt),
                                          run(direct[1], model, a.concurrency - half, a.tokens, salt + 500))
            tps_d.append(d0[1] + d1[1])
            salt += 1
            tps_g.append((await run(gw, model, a.concurrency, a.tokens, salt))[1])
        added = [g - d for g, d in zip(sorted(ttft_g), sorted(ttft_d), strict=False)]
        return {"bench": "gateway_overhead", "flavor": flavor, "topology": a.topology,
                "concurrency": a.concurrency, "tokens": a.tokens, "rounds": a.rounds,
                "direct_ttft_p50_ms": round(pct(ttft_d, 0.5) * 1e3, 3),
                "gateway_ttft_p50_ms": round(pct(ttft_g, 0.5) * 1e3, 3),
                "added_ttft_p50_ms": round((pct(ttft_g, 0.5) - pct(ttft_d, 0.5)) * 1e3, 3),
                "added_ttft_p99_ms": round((pct(ttft_g, 0.99) - pct(ttft_d, 0.99)) * 1e3, 3),
                "added_ttft_median_of_pairs_ms": round(statistics.median(added) * 1e3, 3),
                "direct_tokens_per_s": round(statistics.median(tps_d), 1),
                "gateway_tokens_per_s": round(statistics.median(tps_g), 1),
                "throughput_ratio": round(statistics.median(tps_g) / statistics.median(tps_d), 3)}
    finally:
        stop_processes(procs, 10.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--low-load-requests", type=int, default=30)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--topology", choices=["both", "pd"], default="both",
                    help="two colocated engines, or two prefill/decode pairs")
    ap.add_argument("--flavor", choices=["vllm", "sglang", "vllm-mooncake", "all"], default="vllm",
                    help="engine family (all: one line per family, measured one after the other)")
    a = ap.parse_args()
    for flavor in (["vllm", "sglang", "vllm-mooncake"] if a.flavor == "all" else [a.flavor]):
        print(json.dumps(asyncio.run(main_async(a, flavor))), flush=True)


if __name__ == "__main__":
    main()
