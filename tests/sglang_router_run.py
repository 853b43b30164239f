"""Run SGLang's own router (the ``sglang-router`` package) in front of `--flavor sglang` sim engines
and report, as one JSON object on stdout, what a client got through it.

Meant to run inside a loopback-only network namespace (tests/test_sglang_router_interop.py starts
it under ``unshare -n``): the router looks for the workers' tokenizers on the Hugging Face hub,
and nothing here may leave the machine. ``mode`` is ``pd`` (one prefill and one decode engine,
``--pd-disaggregation``) or ``regular`` (two colocated engines, ``--worker-urls``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engines_adapters.net import free_port  # noqa: E402
from gateway.embedded import stop_processes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim-engine", "--flavor", "sglang", "--port",
                          str(port), "--time-scale", "0.1", "--noise", "0", *args], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if "sim-engine ready" not in line:
        raise RuntimeError(f"sim-engine did not start: {line!r}")
    return p, f"http://127.0.0.1:{port}"


def wait_ok(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def wait_models(base: str, timeout_s: float = 60.0) -> dict:
    """The router's model list once it has admitted its workers (its /health answers before)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = requests.get(base + "/v1/models", timeout=5)
            if r.status_code == 200 and r.json().get("data"):
                return r.json()
        except (requests.RequestException, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router listed no model within {timeout_s} s")
        time.sleep(0.2)


def stream_chat(base: str, text: str, max_tokens: int) -> dict:
    body = {"model": "llama3-8b", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(base + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        lines = [ln.decode() for ln in r.iter_lines() if ln]
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    content = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    return {"status": r.status_code, "content": content, "usage": usage, "done": bool(lines) and
            lines[-1] == "data: [DONE]", "content_chunks": sum(1 for c in chunks if c.get("choices") and
                                                               c["choices"][0]["delta"].get("content"))}


def main(mode: str) -> dict:
    procs: list[subprocess.Popen] = []
    try:
        if mode == "pd":
            boot = free_port()
            p, pu = engine("--role", "prefill", "--disaggregation-bootstrap-port", str(boot))
            d, du = engine("--disaggregation-mode", "decode")
            procs += [p, d]
            workers = ["--pd-disaggregation", "--prefill", pu, str(boot), "--decode", du]
            engines = {"prefill": pu, "decode": du}
        else:
            a, au = engine()
            b, bu = engine()
            procs += [a, b]
            workers = ["--worker-urls", au, bu, "--policy", "round_robin"]
            engines = {"a": au, "b": bu}
        port = free_port()
        log = open(os.environ.get("SGLANG_ROUTER_LOG", os.devnull), "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn",
             *workers], stdout=log, stderr=subprocess.STDOUT))
        base = f"http://127.0.0.1:{port}"
        wait_ok(base + "/health")
        out: dict = {"mode": mode, "models": wait_models(base)}
        out["chats"] = [stream_chat(base, f"question {i}: " + "tell me more " * (10 + i), 8) for i in range(4)]
        r = requests.post(base + "/generate", json={"text": "native generate", "sampling_params": {
            "max_new_tokens": 5, "ignore_eos": True}}, timeout=60)
        out["generate"] = {"status": r.status_code, "body": r.json() if r.ok else r.text}
        out["engines"] = {k: requests.get(u + "/sim/stats", timeout=10).json() for k, u in engines.items()}
        out["metrics"] = {k: requests.get(u + "/metrics", timeout=10).text for k, u in engines.items()}
        return out
    finally:
        stop_processes(procs, 10.0)


def loopback_up() -> None:
    """Bring up ``lo`` in a fresh network namespace (SIOCSIFFLAGS with IFF_UP|IFF_RUNNING), so no
    tool beyond util-linux's ``unshare`` is needed."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up, iff_running = 0x8913, 0x8914, 0x1, 0x40
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sk:
        req = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(sk.fileno(), siocgifflags, req))[1]
        fcntl.ioctl(sk.fileno(), siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up | iff_running, b""))


if __name__ == "__main__":
    if sys.argv[1] == "--lo-up":
        loopback_up()
        sys.argv.pop(1)
    print(json.dumps(main(sys.argv[1])))
