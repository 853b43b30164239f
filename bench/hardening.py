"""Hardening at the network and process level: idle connections, engine faults, SIGTERM.

Starts `conductor serve` on its embedded sim cluster (loopback only, every loop bounded) and prints:

1. idle + live: N idle connections (a third send nothing, a third half a request head, a third a
   head and one byte of body) held while M live streams run: crashes, live streams completed,
   gateway RSS (start, peak, end), idle connections the gateway closed (408 or a close).
2. faults: for each engine role, SIGKILL and SIGSTOP of one engine under streaming load: answers
   by outcome, retries before the first byte (requests decided twice), reservations left once the
   load has drained (admin view and the in-flight gauge), and how long the gateway took to eject
   the engine.
3. lifecycle: repeated runs of a loaded cluster (short requests, then long streams in flight)
   ended by SIGTERM: seconds until the gateway exited, and whether its engines are gone.

    .venv/bin/python bench/hardening.py [--idle 2000] [--live 500] [--fault-streams 48] [--repeats 3]
                                        [--only idle,faults,lifecycle] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engines_adapters.net import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOSE_SLO = "[slo]\nttft_ms = 600000\ntbt_ms = 600000\n"


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def children(pid: int) -> dict[int, str]:
    """The gateway's engine processes: pid -> role."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            for c in f.read().split():
                with open(f"/proc/{c}/cmdline", "rb") as cf:
                    args = cf.read().split(b"\0")
                if b"--role" in args:
                    out[int(c)] = args[args.index(b"--role") + 1].decode()
    return out


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@asynccontextmanager
async def gateway(config: str, log_name: str):
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.toml")
        with open(path, "w") as f:
            f.write(config)
        log = open(os.path.join(tempfile.gettempdir(), f"conductor-hardening-{log_name}.log"), "wb")
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", path, "--port", str(port),
                                 "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONHASHSEED": "0"})
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(1200):  # 120 s at most
                    if proc.poll() is not None:
                        raise RuntimeError(f"gateway exited with {proc.returncode}; see {log.name}")
                    try:
                        async with s.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=1)) as r:
                            if r.status == 200:
                                break
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        pass
                    await asyncio.sleep(0.1)
                else:
                    raise RuntimeError("gateway not ready in 120 s")
                async with s.get(url + "/v1/models") as r:
                    model = (await r.json())["data"][0]["id"]
            yield {"url": url, "proc": proc, "model": model, "port": port, "log": log.name}
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()


async def stream(s: aiohttp.ClientSession, g: dict, i: int, tokens: int, prompt: int = 200) -> str:
    """One streamed request: 'ok', 'http <status> <code>', 'sse <code>' or an exception name."""
    body = {"model": g["model"], "messages": [{"role": "user", "content": f"request {i} " + "x" * prompt}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True}
    try:
        async with s.post(g["url"] + "/v1/chat/completions", json=body, headers={"x-request-id": f"r{i}"}) as r:
            if r.status != 200:
                try:
                    code = (await r.json())["error"]["code"]
                except Exception:
                    code = "?"
                return f"http {r.status} {code}"
            last = b""
            async for line in r.content:
                if line.startswith(b"data: {\"error\""):
                    return f"sse {json.loads(line[6:])['error']['code']}"
                if line.strip():
                    last = line.strip()
            return "ok" if last == b"data: [DONE]" else "truncated"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return type(e).__name__


def tally(outcomes: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o] = out.get(o, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


async def admin(s: aiohttp.ClientSession, g: dict) -> dict[str, dict]:
    async with s.get(g["url"] + "/admin/cluster", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return {i["id"]: i for i in (await r.json())["instances"]}


async def leftovers(s: aiohttp.ClientSession, g: dict) -> dict[str, float]:
    """Reservations still held once the load has drained (bounded wait: releases are asynchronous)."""
    for _ in range(100):
        view = await admin(s, g)
        active = sum(i["active_requests"] for i in view.values())
        reserved = sum(i["reserved_prefill_tokens"] for i in view.values())
        async with s.get(g["url"] + "/metrics") as r:
            inflight = next(float(line.split()[-1]) for line in (await r.text()).splitlines()
                            if line.startswith("conductor_requests_in_flight"))
        if active == reserved == inflight == 0:
            break
        await asyncio.sleep(0.1)
    return {"active_requests": active, "reserved_prefill_tokens": reserved, "in_flight_gauge": inflight}


async def all_decisions(s: aiohttp.ClientSession, g: dict) -> list[dict]:
    """Every decision the gateway still keeps, page by page (newest pages first; bounded)."""
    out: list[dict] = []
    params: dict[str, int] = {"limit": 100}
    for _ in range(1000):
        async with s.get(g["url"] + "/admin/decisions", params=params) as r:
            page = await r.json()
        out = page["decisions"] + out
        if page.get("next_before") is None:
            break
        params["before"] = page["next_before"]
    return out


# --- 1. idle connections + live streams ------------------------------------------------------

async def idle_and_live(n_idle: int, n_live: int, tokens: int) -> dict:
    cfg = "[embedded]\nprefill = 2\ndecode = 2\n" + LOOSE_SLO
    async with gateway(cfg, "idle") as g:
        pid = g["proc"].pid
        engines = children(pid)
        rss = {"start_mb": rss_mb(pid), "peak_mb": 0.0}
        stop_sampling = asyncio.Event()

        async def sample() -> None:
            while not stop_sampling.is_set():
                rss["peak_mb"] = max(rss["peak_mb"], rss_mb(pid))
                await asyncio.sleep(0.2)

        sampler = asyncio.create_task(sample())
        idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        open_errors = 0
        t0 = time.monotonic()
        for i in range(n_idle):
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", g["port"]), 5)
            except (OSError, asyncio.TimeoutError):
                open_errors += 1
                continue
            if i % 3 == 1:
                w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            elif i % 3 == 2:
                w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 999\r\n\r\n{")
            idle.append((r, w))
        opened_s = time.monotonic() - t0
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
            t1 = time.monotonic()
            outcomes = await asyncio.gather(*(stream(s, g, i, tokens) for i in range(n_live)))
            live_s = time.monotonic() - t1
            # the idle connections: what the gateway did with them (408, a close, or still open)
            answered = closed = still_open = 0

            async def fate(r: asyncio.StreamReader) -> str:
                try:
                    data = await asyncio.wait_for(r.read(64), 45)  # past the head/body deadlines
                except asyncio.TimeoutError:
                    return "open"
                except OSError:
                    return "closed"
                return "408" if data.startswith(b"HTTP/1.1 408") else ("other" if data else "closed")

            fates = await asyncio.gather(*(fate(r) for r, _ in idle))
            answered, closed, still_open = fates.count("408"), fates.count("closed"), fates.count("open")
            left = await leftovers(s, g)
        for _, w in idle:
            w.close()
        stop_sampling.set()
        await sampler
        alive = g["proc"].poll() is None and all(not gone(p) for p in engines)
        rss["end_mb"] = rss_mb(pid)
        return {"idle_connections": len(idle), "idle_open_errors": open_errors, "idle_opened_in_s": round(opened_s, 2),
                "live_streams": n_live, "live_outcomes": tally(outcomes), "live_all_ok": outcomes.count("ok") == n_live,
                "live_wall_s": round(live_s, 2), "gateway_and_engines_alive": alive,
                "idle_then_answered_408": answered, "idle_then_closed": closed, "idle_still_open_after_45s": still_open,
                "rss_mb": {k: round(v, 1) for k, v in rss.items()}, "leftover_reservations": left}


# --- 2. engine faults under load ------------------------------------------------------------

async def fault(role: str, sig: signal.Signals, n_streams: int, tokens: int) -> dict:
    # round robin: each engine of the role has work in progress when the fault hits
    cfg = 'policy = "round_robin"\n[embedded]\nprefill = 2\ndecode = 2\n' + LOOSE_SLO
    async with gateway(cfg, f"fault-{role}-{sig.name}") as g:
        victim = next(p for p, r in sorted(children(g["proc"].pid).items()) if r == role)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as s:
            view = await admin(s, g)
            victim_id = next(i for i, v in view.items()
                             if v["role"] == role and v["url"].endswith(f":{_port_of(victim)}"))
            done: list[str] = []
            next_i = [0]

            async def worker() -> None:  # back to back, a bounded number of requests
                while next_i[0] < n_streams * 4:
                    i = next_i[0]
                    next_i[0] += 1
                    done.append(await stream(s, g, i, tokens, prompt=6000))

            workers = [asyncio.create_task(worker()) for _ in range(n_streams)]
            await asyncio.sleep(2.0)  # load established
            os.kill(victim, sig)
            t_sig = time.monotonic()
            eject_s = None
            for _ in range(400):  # 20 s at most
                if not (await admin(s, g))[victim_id]["healthy"]:
                    eject_s = time.monotonic() - t_sig
                    break
                await asyncio.sleep(0.05)
            await asyncio.gather(*workers)
            left = await leftovers(s, g)
            decisions = await all_decisions(s, g)
            per_request: dict[str, int] = {}
            for d in decisions:
                per_request[d["request_id"]] = per_request.get(d["request_id"], 0) + 1
            retried = sum(1 for n in per_request.values() if n > 1)
            # after the fault: a fresh request still works
            after = await stream(s, g, 10**6, 4)
        if sig == signal.SIGSTOP:
            os.kill(victim, signal.SIGCONT)
        alive = g["proc"].poll() is None
    return {"role": role, "signal": sig.name, "engine": victim_id, "requests": len(done), "outcomes": tally(done),
            "retried_before_first_byte": retried, "ejected_after_s": None if eject_s is None else round(eject_s, 2),
            "leftover_reservations": left, "request_after_fault": after, "gateway_alive": alive}


def _port_of(pid: int) -> int:
    """The engine's HTTP port: the one it listens on that is not its KV-event replay socket."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    port = int(args[args.index(b"--port") + 1])
    if port:
        return port
    replay = int(args[args.index(b"--kv-events-replay") + 1].rsplit(b":", 1)[1])
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            local = int(cols[1].split(":")[1], 16)
            if cols[3] == "0A" and cols[9] in inodes and local != replay:  # LISTEN
                return local
    raise RuntimeError(f"no listening port for {pid}")


# --- 3. SIGTERM after a loaded run ----------------------------------------------------------

async def lifecycle(repeats: int, n_requests: int, n_streams: int) -> list[dict]:
    runs = []
    for k in range(repeats):
        cfg = "[embedded]\nprefill = 4\ndecode = 2\n" + LOOSE_SLO
        async with gateway(cfg, f"lifecycle-{k}") as g:
            engines = children(g["proc"].pid)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64),
                                             timeout=aiohttp.ClientTimeout(total=120)) as s:
                loaded = await asyncio.gather(*(stream(s, g, i, 8) for i in range(n_requests)))
            # long streams in flight at the SIGTERM
            s2 = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            pending = [asyncio.create_task(stream(s2, g, 10**5 + i, 4000)) for i in range(n_streams)]
            await asyncio.sleep(1.5)
            t0 = time.monotonic()
            g["proc"].send_signal(signal.SIGTERM)
            code = None
            for _ in range(600):  # 30 s at most
                code = g["proc"].poll()
                if code is not None:
                    break
                await asyncio.sleep(0.05)
            took = time.monotonic() - t0
            streams = await asyncio.gather(*pending)
            await s2.close()
            for _ in range(60):
                if all(gone(p) for p in engines):
                    break
                await asyncio.sleep(0.05)
            runs.append({"run": k + 1, "loaded_requests_ok": loaded.count("ok"), "streams_in_flight": n_streams,
                         "stream_endings": tally(streams), "exit_code": code, "exited_after_s": round(took, 2),
                         "engines_gone": all(gone(p) for p in engines)})
    return runs


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--idle", type=int, default=2000, help="idle connections held (default 2000)")
    p.add_argument("--live", type=int, default=500, help="live streams beside them (default 500)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per live stream (default 32)")
    p.add_argument("--fault-streams", type=int, default=48, help="concurrent streams in the fault runs (default 48)")
    p.add_argument("--repeats", type=int, default=3, help="SIGTERM lifecycle runs (default 3)")
    p.add_argument("--only", default="idle,faults,lifecycle", help="which parts, comma-separated")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # our own 2,500 client sockets
    parts = set(args.only.split(","))
    results: dict = {"machine": f"{os.cpu_count()} cores, shared", "open_files_limit": hard}
    if "idle" in parts:
        r = await idle_and_live(args.idle, args.live, args.tokens)
        results["idle_and_live"] = r
        print(json.dumps({"idle_and_live": r}), flush=True)
    if "faults" in parts:
        results["faults"] = []
        for role in ("prefill", "decode"):
            for sig in (signal.SIGKILL, signal.SIGSTOP):
                r = await fault(role, sig, args.fault_streams, 256)
                results["faults"].append(r)
                print(json.dumps({"fault": r}), flush=True)
    if "lifecycle" in parts:
        results["lifecycle"] = await lifecycle(args.repeats, 1000, 48)
        for r in results["lifecycle"]:
            print(json.dumps({"sigterm": r}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
