"""Starting and stopping real `conductor` processes on free loopback ports, for tests."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import requests

from engines_adapters.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: each started process's log, so a failure to start can say why
_LOGS: dict[int, str] = {}
_TEMP_LOGS: set[str] = set()  # those this module made (removed when their process is stopped)


def conductor(*args: str, log: str | None = None) -> subprocess.Popen:
    if log is None:
        fd, log = tempfile.mkstemp(prefix="conductor-", suffix=".log")
        os.close(fd)
        _TEMP_LOGS.add(log)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONHASHSEED": "0"})
    _LOGS[proc.pid] = log
    return proc


def log_tail(proc: subprocess.Popen, lines: int = 30) -> str:
    """The end of what ``proc`` (started by :func:`conductor`) printed."""
    try:
        with open(_LOGS[proc.pid], errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except (KeyError, OSError):
        return "(no log)"


def wait_until(url: str, proc: subprocess.Popen, timeout_s: float = 60.0, status: int = 200) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered; "
                               f"its log ends:\n{log_tail(proc)}")
        try:
            if requests.get(url, timeout=1).status_code == status:
                return
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer {status} within {timeout_s} s; its log ends:\n{log_tail(proc)}")


def stop(*procs: subprocess.Popen) -> None:
    """Stop ``procs`` (SIGTERM, then SIGKILL after 10 s) and forget their logs if temporary."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log = _LOGS.pop(p.pid, None)
        if log is not None and log in _TEMP_LOGS:
            _TEMP_LOGS.discard(log)
            os.unlink(log)


#: the PD protocols every end-to-end gateway scenario runs against
FLAVORS = ("vllm", "sglang", "vllm-mooncake")


@contextmanager
def sim_engine(role: str, *extra: str, flavor: str = "vllm"):
    engine = RestartableEngine(role, *extra, flavor=flavor)
    engine.start()
    try:
        yield {"url": engine.url, "port": engine.port, "kv": engine.kv, "replay": engine.replay, "proc": engine.proc,
               "engine": engine}
    finally:
        engine.stop()


#: how often a gateway is restarted on a fresh port when another process took its port first
PORT_RETRIES = 3


def serve(cfg: str, log: str, *flags: str, timeout_s: float = 90.0) -> tuple[subprocess.Popen, str]:
    """``conductor serve --config cfg`` on a free loopback port, ready: (process, base URL). The
    port is free when chosen but not reserved until the gateway binds it (first thing, before it
    starts anything): another process can take it in between, so a start that fails only with
    EADDRINUSE is retried on a new port."""
    for attempt in range(PORT_RETRIES):
        port = free_port()
        proc = conductor("serve", "--config", cfg, "--port", str(port), "--log-level", "warning", *flags, log=log)
        try:
            wait_until(f"http://127.0.0.1:{port}/ready", proc, timeout_s=timeout_s)
            return proc, f"http://127.0.0.1:{port}"
        except (RuntimeError, TimeoutError) as e:  # its message ends with the gateway's own last words
            stop(proc)
            if "address already in use" in str(e).lower() and attempt + 1 < PORT_RETRIES:
                continue
            raise
    raise AssertionError("unreachable")


@contextmanager
def gateway(config_text: str = "", *, log_dir: str | None = None):
    """A running ``conductor serve`` (:func:`serve`), stopped on exit."""
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "conductor.toml")
        with open(cfg, "w") as f:
            f.write(config_text)
        proc, url = serve(cfg, os.path.join(log_dir or d, "gateway.log"))
        try:
            yield {"url": url, "proc": proc, "dir": d}
        finally:
            stop(proc)


def engine_entry(eid: str, role: str, url: str, kv: str | None = None, replay: str | None = None, *,
                 protocol: str = "vllm", bootstrap_port: int | None = None) -> list[str]:
    """The ``[[engines]]`` lines of a gateway config naming one sim engine."""
    lines = ["[[engines]]", f'id = "{eid}"', f'role = "{role}"', 'kind = "sim"', f'url = "{url}"',
             f'protocol = "{protocol}"']
    if bootstrap_port is not None:
        lines.append(f"bootstrap_port = {bootstrap_port}")
    if kv:
        lines += [f'kv_events = "{kv}"', f'kv_events_replay = "{replay}"']
    return lines


class RestartableEngine:
    """A sim engine on fixed loopback ports (HTTP, KV events, replay) that a test can stop and
    start again on the same address, as an engine restart looks to the gateway."""

    def __init__(self, role: str = "both", *extra: str, flavor: str = "vllm"):
        from gateway.embedded import BOOTSTRAP_FLAGS, sim_flavor_args

        self.role, self.flavor = role, flavor
        self.bootstrap = free_port() if flavor != "vllm" and role == "prefill" else None
        self.extra = (*sim_flavor_args(flavor), *extra)
        if self.bootstrap is not None:
            self.extra += (BOOTSTRAP_FLAGS[flavor], str(self.bootstrap))
        self.port, kv, replay = free_port(), free_port(), free_port()
        self.url, self.kv, self.replay = f"http://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{kv}", f"tcp://127.0.0.1:{replay}"
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> None:
        self.proc = conductor("sim-engine", "--role", self.role, "--port", str(self.port), "--kv-events", self.kv,
                              "--kv-events-replay", self.replay, *self.extra)
        if wait:
            wait_until(self.url + "/health", self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def entry(self, eid: str, events: bool = True) -> list[str]:
        return engine_entry(eid, self.role, self.url, self.kv if events else None, self.replay,
                            protocol=self.flavor, bootstrap_port=self.bootstrap)
