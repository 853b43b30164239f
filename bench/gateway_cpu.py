"""The gateway's own CPU per request: one ``conductor serve`` over its embedded sim cluster, a
bounded closed-loop run of the synthetic workload, and the gateway process's CPU seconds.

    .venv/bin/python bench/gateway_cpu.py [--requests 300] [--concurrency 48] [--stream-fraction 0.5]
        [--profile] [--top 25] [--out DIR]
    .venv/bin/python bench/gateway_cpu.py --relay-only [--events 50000]

Why: on a 2-core machine the gateway's CPU, not the policy, limited the live runs (bench/
live_arrival_probe.py). CPU time, unlike wall time, is robust to the machine's other load.
The gateway is the live baselines' (``_common.start_gateway``: conductor, admission on, 4 prefill +
2 decode sim engines, no store) with a TTFT SLO of 10 minutes, so nothing is refused. The requests
are ``_common.SYNTHETIC``'s (lognormal prompt and output lengths, 4-turn conversations behind a
shared system prompt), sent in order by ``--concurrency`` clients, each request streamed
(``include_usage``) with probability ``--stream-fraction``, else answered whole. A warm-up of
``--warmup`` requests comes first, uncounted. The gateway's CPU is utime + stime of its process
(``/proc/PID/stat``; the engines are other processes and not counted) over the counted requests,
and also net of its idle rate (health and load polls) measured for ``--idle-s`` before them.

``--profile``: the gateway runs with ``CONDUCTOR_PROFILE`` (gateway/profiling.py) and profiles the
counted requests only, in CPU time of its event loop's thread; the JSON then holds the top
functions by own time and the cumulative time of the request's phases (names in PHASES), in ms
per request. cProfile slows the gateway (about 2x, most in small functions): its figures are
shares of the profiled run, not the unprofiled CPU.

``--relay-only``: no gateway, no network: the SSE relay (``gateway.streaming.UpstreamStream``) in
this process, fed one token event per read by a fake engine body and forwarding to a no-op ASGI
send, on uvloop; prints its CPU microseconds per event (the loop's own turn per read included).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "experiments"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import _common as C  # noqa: E402
from live_arrival_probe import cpu_s  # noqa: E402

from gateway.profiling import ENV  # noqa: E402
from loadgen.prompts import PromptSynth, build_body  # noqa: E402
from loadgen.synthetic import parse_dist, synthetic_workload  # noqa: E402
from tests.servers import stop  # noqa: E402

#: a request's phases in the gateway, as (label, file suffix, function name): cumulative time
PHASES = [
    ("handler (to the response)", "gateway/proxy.py", "handle"),
    ("  read body", "gateway/proxy.py", "_read_body"),
    ("  parse and validate", "gateway/requests.py", "parse_body"),
    ("  tokenize", "gateway/tokenizers.py", "tokens"),
    ("  block hashes", "scheduler/hashing.py", "block_hashes"),
    ("  decide (offer)", "gateway/waiting.py", "offer"),
    ("  open the pair (vLLM driver)", "engines_adapters/drivers/vllm.py", "open"),
    ("  whole answer", "gateway/proxy.py", "_whole"),
    ("stream relay", "gateway/streaming.py", "__call__"),
    ("  scan events", "gateway/streaming.py", "scan_events"),
    ("finish (lifecycle)", "scheduler/lifecycle.py", "finish"),
    ("  metrics observe", "gateway/observability.py", "observe"),
    ("  predictors observe", "predictors/base.py", "observe"),
    ("HTTP server (uvicorn)", "uvicorn/protocols/http/httptools_impl.py", "data_received"),
    ("ASGI app (all routes)", "starlette/applications.py", "__call__"),
]


def workload(n: int, seed: int) -> list[Any]:
    """``n`` requests of ``_common.SYNTHETIC`` (the rate only orders them: the run is closed-loop)."""
    s = C.SYNTHETIC
    return synthetic_workload(n, 10.0, input_tokens=parse_dist(s["input_tokens"]),
                              output_tokens=parse_dist(s["output_tokens"]), process=s["process"], cv=s["cv"],
                              turns=s["turns"], turn_gap_s=s["turn_gap_s"],
                              shared_prefix_blocks=s["shared_prefix_blocks"], seed=seed).requests


async def send_all(url: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, int]:
    """Send every body, ``concurrency`` at a time; count outcomes and streamed events."""
    counts = {"ok": 0, "failed": 0, "events": 0}
    queue = list(reversed(bodies))

    async def client(s: aiohttp.ClientSession) -> None:
        while queue:
            body = queue.pop()
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                if body["stream"]:
                    async for line in r.content:
                        counts["events"] += line.startswith(b"data: ")
                else:
                    await r.read()
                counts["ok" if r.status == 200 else "failed"] += 1

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        await asyncio.gather(*(client(s) for _ in range(concurrency)))
    return counts


def bodies(reqs: list[Any], model: str, stream_fraction: float, seed: int) -> list[dict[str, Any]]:
    synth, rng = PromptSynth(salt=f"gateway-cpu-{seed}"), random.Random(seed)
    out = []
    for r in reqs:
        body, _ = build_body(r, synth, model=model)
        if rng.random() >= stream_fraction:
            body["stream"] = False
            del body["stream_options"]
        out.append(body)
    return out


def phases(stats: pstats.Stats, n: int) -> dict[str, float]:
    """Cumulative ms per request of each of PHASES found in the profile."""
    out: dict[str, float] = {}
    for label, suffix, name in PHASES:
        cum = sum(v[3] for (file, _, fn), v in stats.stats.items()  # type: ignore[attr-defined]
                  if fn == name and file.endswith(suffix))
        if cum:
            out[label] = round(cum * 1e3 / n, 3)
    return out


def top(stats: pstats.Stats, n: int, k: int) -> list[list[Any]]:
    """The ``k`` functions with the most own time: [where, calls per request, own ms/request, cumulative ms/request]."""
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:k]  # type: ignore[attr-defined]
    rel = str(ROOT) + "/"
    return [[f"{file.replace(rel, '').split('site-packages/')[-1]}:{line}({fn})", round(v[1] / n, 1),
             round(v[2] * 1e3 / n, 3), round(v[3] * 1e3 / n, 3)] for (file, line, fn), v in rows]


async def wait_file(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway wrote no profile to {path}")
        await asyncio.sleep(0.1)


async def measure(a: argparse.Namespace, url: str, pid: int, prof: Path | None) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    reqs = workload(a.warmup + a.requests, a.seed)
    all_bodies = bodies(reqs, model, a.stream_fraction, a.seed)
    await send_all(url, all_bodies[: a.warmup], a.concurrency)
    c0, t0 = cpu_s(pid), time.monotonic()
    await asyncio.sleep(a.idle_s)
    idle_rate = (cpu_s(pid) - c0) / (time.monotonic() - t0)
    if prof is not None:
        os.kill(pid, signal.SIGUSR1)
    c0, t0 = cpu_s(pid), time.monotonic()
    counts = await send_all(url, all_bodies[a.warmup:], a.concurrency)
    cpu, wall = cpu_s(pid) - c0, time.monotonic() - t0
    n = a.requests
    res: dict[str, Any] = {
        "bench": "gateway_cpu", "requests": n, "concurrency": a.concurrency, "stream_fraction": a.stream_fraction,
        "streamed": sum(b["stream"] for b in all_bodies[a.warmup:]), **counts,
        "prompt_tokens_mean": round(sum(r.input_length for r in reqs[a.warmup:]) / n),
        "output_tokens_mean": round(sum(r.output_length for r in reqs[a.warmup:]) / n),
        "wall_s": round(wall, 1), "gateway_cpu_s": round(cpu, 2), "cpu_ms_per_request": round(cpu * 1e3 / n, 2),
        "idle_cpu_ms_per_s": round(idle_rate * 1e3, 2),
        "cpu_ms_per_request_net_of_idle": round((cpu - idle_rate * wall) * 1e3 / n, 2),
        "profiled": prof is not None, "load_average": os.getloadavg()[0]}
    if prof is not None:
        os.kill(pid, signal.SIGUSR2)
        await wait_file(prof)
        stats = pstats.Stats(str(prof))
        res["profile_total_ms_per_request"] = round(stats.total_tt * 1e3 / n, 2)  # type: ignore[attr-defined]
        res["phases_ms_per_request"] = phases(stats, n)
        res["top_own_time"] = top(stats, n, a.top)
    return res


#: a chat completion chunk as the sim engine streams it (one token)
TOKEN_EVENT = (b'data: {"id":"chatcmpl-cmpl-0123456789abcdef","object":"chat.completion.chunk","created":1764593000,'
               b'"model":"llama3-8b","choices":[{"index":0,"delta":{"content":"abc"},"logprobs":null,'
               b'"finish_reason":null}]}\n\n')


def relay_only(events: int) -> dict[str, Any]:
    """CPU microseconds per event of the relay alone (see the module's doc)."""
    import uvloop

    from gateway.streaming import UpstreamStream

    class Body:
        left = events

        async def readany(self) -> bytes:
            await asyncio.sleep(0)  # the next event is ready after one turn of the loop
            if not self.left:
                return b""
            self.left -= 1
            return TOKEN_EVENT

    class Upstream:
        content = Body()

        def close(self) -> None:
            pass

    async def send(message: dict) -> None:
        pass

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client stays to the end
        return {}

    async def run() -> float:
        stream = UpstreamStream(Upstream(), {}, lambda tally: None, idle_timeout_s=30)  # type: ignore[arg-type]
        t0 = time.process_time()
        await stream({"type": "http"}, receive, send)
        return time.process_time() - t0

    cpu = uvloop.run(run())
    return {"bench": "gateway_cpu", "relay_only": True, "events": events,
            "cpu_us_per_event": round(cpu * 1e6 / events, 2), "load_average": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300, help="counted requests")
    p.add_argument("--warmup", type=int, default=20, help="uncounted requests first")
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle CPU measured before the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="profile the counted requests (cProfile in the gateway)")
    p.add_argument("--top", type=int, default=25, help="functions listed with --profile")
    p.add_argument("--out", type=Path, default=C.OUT / "gateway-cpu")
    p.add_argument("--relay-only", action="store_true", help="the SSE relay alone, in this process (no gateway)")
    p.add_argument("--events", type=int, default=50000, help="events relayed with --relay-only")
    a = p.parse_args(argv)
    if a.relay_only:
        print(json.dumps(relay_only(min(a.events, 10**6))))
        return
    if not 0 < a.requests <= 5000 or not 0 < a.concurrency <= 512:
        p.error("--requests must be in 1..5000 and --concurrency in 1..512 (a bounded run)")
    a.out.mkdir(parents=True, exist_ok=True)
    prof = a.out / "gateway.prof" if a.profile else None
    if prof is not None:
        prof.unlink(missing_ok=True)
        os.environ[ENV] = str(prof)  # the gateway inherits it (the engines ignore it)
    proc, url = C.start_gateway(a.out, "gateway", policy="conductor", store=False, admission=True,
                                prefill=4, decode=2, ttft_ms=600000, tbt_ms=600000)
    try:
        res = asyncio.run(measure(a, url, proc.pid, prof))
    finally:
        stop(proc)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
