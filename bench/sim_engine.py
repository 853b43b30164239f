"""Benchmark of the simulated engine: what it models, how fast it serves, what a step costs.

    .venv/bin/python bench/sim_engine.py [--quick] [--skip-server]

1. Each profile's single-request TTFT at 1k/8k/32k/128k prompt tokens and decode TBT at batch
   1/32/128 (1k-token contexts), then the calibration anchors: the timing model evaluated on the
   anchor's own hardware beside the public measurement it was fitted to or checked against.
2. Streamed tokens per second one sim-engine process sustains with 256 concurrent SSE streams
   (small time scale, so the process, not the model, is the limit).
3. CPU microseconds per EngineModel.step at batch 256 (decode only; with KV events; mixed).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines_adapters.sim.model import EngineModel, SimRequest  # noqa: E402
from engines_adapters.sim.profiles import load_profile, profile_names  # noqa: E402
from engines_adapters.sim.timing import StepTimer, chunk_ctx  # noqa: E402

VIDUR = "microsoft/vidur data/profiling"
# Public measurements (sum over one forward of the per-layer operator medians x layers, no
# embedding / LM head / attention, in ms), see docs/sim_engine.md for how they were read.
ANCHORS_GEMM = {
    "llama3-8b-h200": ("A100-80GB, Llama-3-8B TP1",
                       {"gpu": "A100", "gpus": 1, "peak_tflops": 312.0, "hbm_gbps": 2039.0},
                       f"{VIDUR}/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv",
                       {1: 9.70, 32: 10.91, 256: 19.49, 1024: 75.14, 4096: 273.6, 8192: 543.9}),
    "llama3-70b-a800x8": ("A100-80GB x8, Llama-3-70B TP8", {"gpu": "A100", "gpus": 8, "peak_tflops": 312.0,
                                                            "hbm_gbps": 2039.0},
                          f"{VIDUR}/compute/a100/meta-llama/Meta-Llama-3-70B/mlp.csv",
                          {1: 14.28, 32: 14.88, 256: 30.60, 1024: 94.44, 4096: 355.4, 8192: 701.5}),
}
ALLREDUCE_A100 = {2048: 0.062, 16 * 2**20: 0.275, 64 * 2**20: 0.675}  # ms, 8 x A100 DGX (Vidur network/a100_dgx)


def ttft(profile_name: str, n: int) -> float:
    e = EngineModel(load_profile(profile_name), noise=0)
    e.add_request(SimRequest("r", [65 + i % 26 for i in range(n)], 1, output_len=1), 0.0)
    now = 0.0
    while e.has_work():
        r = e.step(now)
        now = r.end
        if r.finished:
            return r.finished[0].first_token
    raise RuntimeError("no first token")


def tbt(profile_name: str, batch: int, ctx: int = 1024) -> float:
    e = EngineModel(load_profile(profile_name), noise=0)
    for i in range(batch):
        e.add_request(SimRequest(f"r{i}", [65 + (i + j) % 26 for j in range(ctx)], 10_000, output_len=10_000), 0.0)
    now = 0.0
    for _ in range(10_000):
        r = e.step(now)
        now = r.end
        if r.decode_seqs == batch and not r.prefill_tokens:
            break
    durs = []
    for _ in range(16):
        r = e.step(now)
        now = r.end
        durs.append(r.duration)
    return statistics.mean(durs)


def section_model(quick: bool) -> None:
    print("== 1. Modelled latency per profile (noise off) ==")
    for name in profile_names():
        p = load_profile(name)
        print(f"\n[{name}] {p.description}; KV {p.kv_bytes_per_token / 1024:.0f} KiB/token, "
              f"capacity {p.kv_capacity_tokens:,} tokens, net {p.net_bytes_per_s / 1e9:.0f} GB/s")
        lengths = (1024, 8192, 32768) if quick else (1024, 8192, 32768, 131071)
        print("  TTFT (single request): " + ", ".join(f"{round(n / 1024)}k: {ttft(name, n) * 1e3:,.0f} ms"
                                                      for n in lengths))
        tbts = ", ".join(f"batch {b}: {tbt(name, b) * 1e3:.1f} ms" for b in (1, 32, 128))
        print("  TBT (1k-token contexts): " + tbts)
        xfer = 8192 * p.kv_bytes_per_token / p.net_bytes_per_s + p.efficiency["transfer_latency_ms"] / 1e3
        print(f"  KV transfer of an 8k-token prompt: {xfer * 1e3:.1f} ms")

    print("\n== 1b. Calibration anchors: the model on the anchor's hardware vs the public figure ==")
    for name, (what, hw, src, table) in ANCHORS_GEMM.items():
        t = StepTimer(load_profile(name).with_overrides(hardware=hw))
        print(f"\n  GEMM + elementwise per forward, {what}, efficiencies of {name}  [{src}]")
        print("    tokens   measured ms   model ms   error")
        for n, ms in table.items():
            m = t.linear(n, 0, lm_head=False) * 1e3
            print(f"    {n:>6}   {ms:>11.2f}   {m:>8.2f}   {m / ms - 1:+6.1%}")
    t = StepTimer(load_profile("llama3-70b-a800x8").with_overrides(hardware={"nvlink_gbps": 300.0}))
    print(f"\n  8-GPU all-reduce on A100 NVLink (300 GB/s per direction)  [{VIDUR}/network/a100_dgx/all_reduce.csv]")
    for nbytes, ms in ALLREDUCE_A100.items():
        m = t.one_allreduce(nbytes) * 1e3
        print(f"    {nbytes / 2**20:>8.3f} MiB   measured {ms:.3f} ms   model {m:.3f} ms   {m / ms - 1:+6.1%}")
    # MInference (NeurIPS'24): "it takes 30 minutes for an 8B LLM to process a prompt of 1M tokens on a single A100"
    t = StepTimer(load_profile("llama3-8b-h200").with_overrides(hardware={"gpus": 1, "peak_tflops": 312.0,
                                                                           "hbm_gbps": 2039.0}))
    total, c = 0.0, 0
    while c < 1 << 20:
        n = min(8192, (1 << 20) - c)
        total += t.duration(n, 1, chunk_ctx(c, n), 0)
        c += n
    print(f"\n  8B prefill of 1M tokens on one A100 (MInference: ~30 min): model {total / 60:.1f} min "
          f"({total / 1800 - 1:+.0%})")
    # vLLM 0.21, Llama-3.1-8B on one H100-80GB, concurrency 1: TPOT p50 6.48 ms (InferenceBench concurrency sweep)
    t = StepTimer(load_profile("llama3-8b-h200").with_overrides(hardware={"peak_tflops": 989.0, "hbm_gbps": 3350.0}))
    m = t.duration(1, 1, 0, 512) * 1e3
    print(f"  8B batch-1 TPOT on one H100 (vLLM 0.21 measured 6.48 ms): model {m:.2f} ms ({m / 6.48 - 1:+.1%})")


class _StreamCounter(asyncio.Protocol):
    """A minimal SSE client (raw socket, no HTTP library): counts streamed content characters,
    so the client costs far less CPU than the server it measures."""

    def __init__(self, request: bytes, done: asyncio.Future):
        self.request, self.done, self.buf, self.tokens = request, done, b"", 0

    def connection_made(self, transport):
        transport.write(self.request)

    def data_received(self, data: bytes):
        buf = self.buf + data
        cut = buf.rfind(b"\n\n") + 2
        whole, self.buf = buf[:cut], buf[cut:]
        k = whole.find(b'"content":"')
        while k >= 0:
            end = whole.find(b'"', k + 11)
            self.tokens += end - (k + 11)
            k = whole.find(b'"content":"', end)

    def connection_lost(self, exc):
        if not self.done.done():
            self.done.set_result(self.tokens)


async def _streams(port: int, n: int, max_tokens: int) -> tuple[int, float, float]:
    """(tokens received, wall seconds, modelled busy seconds) for n concurrent streams."""
    import json

    loop = asyncio.get_running_loop()

    async def busy() -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /sim/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = await reader.read()
        writer.close()
        return json.loads(raw.split(b"\r\n\r\n", 1)[1])["busy_s"]

    body = json.dumps({"model": "llama3-8b", "messages": [{"role": "user", "content": "Go."}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
    busy0 = await busy()
    t0 = time.perf_counter()
    futs = []
    for i in range(n):
        req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"X-Request-Id: b{i}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        fut = loop.create_future()
        await loop.create_connection(lambda r=req, f=fut: _StreamCounter(r, f), "127.0.0.1", port)
        futs.append(fut)
    counts = await asyncio.gather(*futs)
    wall = time.perf_counter() - t0
    return sum(counts), wall, await busy() - busy0


def section_server(quick: bool) -> None:
    print("\n== 2. Streamed tokens per second of one sim-engine process, 256 concurrent SSE streams ==")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    max_tokens = 200 if quick else 1000
    for scale in (0.001,):
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from gateway.cli import main; "
                                 "sys.exit(main(sys.argv[1:]))", "sim-engine", "--role", "both", "--port", "0",
                                 "--time-scale", str(scale)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
        try:
            line = proc.stdout.readline()
            port = int(line.split("http://127.0.0.1:")[1].split()[0])
            cpu0 = _proc_cpu(proc.pid)
            tokens, wall, modelled = asyncio.run(_streams(port, 256, max_tokens))
            cpu = _proc_cpu(proc.pid) - cpu0
        finally:
            proc.terminate()
            proc.wait(10)
        print(f"  time scale {scale}: {tokens:,} tokens in {wall:.2f} s wall = {tokens / wall:,.0f} tokens/s "
              f"(server CPU {cpu:.2f} s = {cpu / wall:.0%} of a core; client in this process)")
        need = tokens / modelled
        print(f"  the modelled GPU needed {modelled:.1f} s for them ({need:,.0f} tokens/s at batch 256), so this "
              f"process keeps 256 streams in real time down to --time-scale {need / (tokens / wall):.2f}")


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def section_cpu() -> None:
    print("\n== 3. CPU cost of EngineModel.step at batch 256 ==")
    p = load_profile("llama3-8b-h200")
    for label, kw, mixed in (("256 decodes", {}, False), ("256 decodes, KV events on", {"kv_events": True}, False),
                             ("256 decodes + a 2k-token prefill", {}, True),
                             ("256 decodes + a 2k-token prefill, KV events on", {"kv_events": True}, True)):
        e = EngineModel(p, max_num_seqs=257 if mixed else 256, **kw)
        for i in range(256):
            e.add_request(SimRequest(f"s{i}", [65 + (i * 7 + j) % 26 for j in range(500 + i)], 50_000,
                                     output_len=50_000), 0.0)
        now = 0.0
        while e.stats().running < 256 or e.stats().queued_prefill_tokens:
            now = e.step(now).end
        if mixed:
            for k in range(1200):
                uniq = list(f"{k:06d}".encode())  # distinct first block: no prefix hits
                e.add_request(SimRequest(f"p{k}", uniq + [65 + (k + j) % 26 for j in range(2042)], 1, output_len=1),
                              now)
        times = []
        for _ in range(1000):
            t0 = time.perf_counter()
            r = e.step(now)
            times.append(time.perf_counter() - t0)
            now = r.end
        times.sort()
        print(f"  {label:<47} mean {statistics.mean(times) * 1e6:6.0f} us   p50 {times[500] * 1e6:6.0f} us   "
              f"p99 {times[990] * 1e6:6.0f} us   (batch {r.decode_seqs} decodes + {r.prefill_tokens} prefill tokens)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (skips the 128k TTFT)")
    ap.add_argument("--skip-server", action="store_true", help="skip section 2 (starts a server process)")
    args = ap.parse_args()
    section_model(args.quick)
    if not args.skip_server:
        section_server(args.quick)
    section_cpu()
    return 0


if __name__ == "__main__":
    sys.exit(main())
