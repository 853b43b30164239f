"""Helpers for tests that run real ``conductor sim-engine`` processes on loopback.

``SimEngineProcess`` starts one with ``--port 0``, waits (bounded) for its ready line, and kills
it on exit, whatever happens. ``wait_until`` polls a condition with a deadline instead of
sleeping and hoping.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HASH_SEED = "0"
# the `conductor` entry point (not `python -m gateway.cli`, which would load gateway.cli twice)
CONDUCTOR = [sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main(sys.argv[1:]))"]


def wait_until(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``cond`` until it returns a truthy value (returned) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def run_cli(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run([*CONDUCTOR, "sim-engine", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=_env())


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = HASH_SEED
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class SimEngineProcess:
    """A sim-engine subprocess; use as a context manager."""

    command = "sim-engine"

    def __init__(self, *args: str, role: str = "both", time_scale: float = 0.05, startup_timeout: float = 20.0):
        self.args = ["--role", role, "--port", "0", "--time-scale", str(time_scale), *args]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "SimEngineProcess":
        self.proc = subprocess.Popen([*CONDUCTOR, self.command, *self.args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        try:
            line = self._ready_line()
            self.port = int(line.split("http://127.0.0.1:")[1].split()[0])
        except BaseException:
            self.stop()
            raise
        return self

    def _ready_line(self) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.startup_timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.command} exited {self.proc.returncode}: {self.proc.stderr.read()}")
                if sel.select(timeout=0.1):
                    line = self.proc.stdout.readline()
                    if f"{self.command} ready" in line:
                        return line
        finally:
            sel.close()
        raise RuntimeError(f"{self.command} did not become ready in time")

    def stop(self) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for f in (p.stdout, p.stderr):
            if f:
                f.close()
        self.proc = None

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- tiny HTTP client (stdlib: independent of the server's own libraries) ---------------
    def request(self, method: str, path: str, body: Any = None, headers: dict | None = None,
                raw: bytes | None = None, timeout: float = 30.0) -> tuple[int, dict, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, hdrs, payload = r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            status, hdrs, payload = e.code, dict(e.headers), e.read()
        ctype = hdrs.get("Content-Type", "")
        if "json" in ctype:
            return status, hdrs, json.loads(payload)
        return status, hdrs, payload.decode()

    def post(self, path: str, body: Any = None, **kw) -> tuple[int, dict, Any]:
        return self.request("POST", path, body, **kw)

    def get(self, path: str, **kw) -> tuple[int, dict, Any]:
        return self.request("GET", path, **kw)

    def stats(self) -> dict:
        return self.get("/sim/stats")[2]

    def metric(self, name: str) -> float:
        """One sample of a Prometheus metric from /metrics (first matching line)."""
        text = self.get("/metrics")[2]
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


class SimStoreProcess(SimEngineProcess):
    """A ``conductor sim-store`` subprocess (same tiny client); use as a context manager."""

    command = "sim-store"

    def __init__(self, *args: str, time_scale: float = 0.05, startup_timeout: float = 20.0):
        self.args = ["--port", "0", "--time-scale", str(time_scale), *args]
        self.startup_timeout = startup_timeout
        self.proc = None
        self.port = 0
