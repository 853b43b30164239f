"""The embedded simulated cluster: `conductor serve` with no configuration starts sim engines
as child processes on loopback (each with KV events) and routes to them."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import aiohttp

from engines_adapters.net import free_port
from engines_adapters.sim.profiles import load_profile
from gateway.config import EmbeddedConfig, EngineConfig


def _die_with_parent() -> None:
    """Runs in the child before exec: on Linux, SIGTERM the engine if the gateway dies (even by
    SIGKILL), so an embedded cluster never outlives its gateway."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() still ends the engines on a normal shutdown


#: every embedded engine process alive, for a gateway that must end at once (its shutdown overran)
_LIVE: set[subprocess.Popen] = set()


def kill_all() -> None:
    """SIGKILL every embedded engine still alive (a stopped one too: SIGTERM would wait for SIGCONT)."""
    for p in list(_LIVE):
        try:
            p.kill()
        except OSError:
            pass


_READY = re.compile(rb"^sim-engine ready: http://[^ ]+:(\d+) ")


def _relay(p: subprocess.Popen, port: list[int]) -> None:
    """Pass an engine's stdout on to ours, noting the port its ready line names."""
    assert p.stdout is not None
    for line in p.stdout:
        m = _READY.match(line)
        if m and not port:
            port.append(int(m.group(1)))
        try:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        except (OSError, ValueError):
            pass


class EmbeddedCluster:
    def __init__(self, cfg: EmbeddedConfig):
        self.cfg = cfg
        self.procs: list[subprocess.Popen] = []
        self.engines: list[EngineConfig] = []
        self._ports: list[list[int]] = []  # per engine: its HTTP port once it said

    def start(self) -> list[EngineConfig]:
        self.plan()
        return self.launch()

    def plan(self) -> list[EngineConfig]:
        """The engines' configurations, before any starts: each KV-event endpoint has port 0, for
        the gateway to bind first (``Cluster.open_kv_events`` writes the real port back)."""
        roles = ["prefill"] * self.cfg.prefill + ["decode"] * self.cfg.decode + ["both"] * self.cfg.both
        counters: dict[str, int] = {}
        # the gateway gets only the public deployment the engines emulate (never their calibration),
        # time-scaled when they run at a time scale so predictions are in wall-clock seconds
        deployment = load_profile(self.cfg.profile).deployment.time_scaled(self.cfg.time_scale).name
        for role in roles:
            counters[role] = counters.get(role, 0) + 1
            eid = f"{role}-{counters[role]}"
            replay = free_port()
            # port 0: the engine binds a port of the OS's choosing and says which (see launch)
            self.engines.append(EngineConfig(id=eid, role=role, url="http://127.0.0.1:0", kind="sim",
                                             kv_events="tcp://127.0.0.1:0",
                                             kv_events_replay=f"tcp://127.0.0.1:{replay}",
                                             deployment=deployment))
        return self.engines

    def launch(self) -> list[EngineConfig]:
        """Start the planned engines (a KV-event endpoint still at port 0 gets a free port). Each
        binds its HTTP port itself (``--port 0``) and prints it; ``wait_ready`` reads it. No port
        is chosen here for an engine to bind later: another socket could take it meanwhile, even
        our own health checks (a loopback connect to a port not yet bound can connect to itself)."""
        env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
        for i, e in enumerate(self.engines):
            if e.kv_events == "tcp://127.0.0.1:0":
                e.kv_events = f"tcp://127.0.0.1:{free_port()}"
            args = [sys.executable, "-m", "gateway.cli", "sim-engine", "--role", e.role, "--port", "0",
                    "--kv-events", e.kv_events, "--kv-events-replay", e.kv_events_replay or "",
                    "--profile", self.cfg.profile, "--time-scale", str(self.cfg.time_scale),
                    "--seed", str(self.cfg.seed + i), *self.cfg.extra_args]
            p = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 preexec_fn=_die_with_parent)
            self.procs.append(p)
            _LIVE.add(p)
            self._ports.append([])
            threading.Thread(target=_relay, args=(p, self._ports[-1]), daemon=True, name=f"stdout-{e.id}").start()
        return self.engines

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            for e, p, port in zip(self.engines, self.procs, self._ports, strict=True):
                while True:
                    if p.poll() is not None:
                        raise RuntimeError(f"embedded engine {e.id} exited with code {p.returncode}")
                    if port:  # bound and listening: health checks are safe now
                        e.url = f"http://127.0.0.1:{port[0]}"
                        try:
                            async with s.get(e.url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                                if r.status == 200:
                                    break
                        except (aiohttp.ClientError, asyncio.TimeoutError):
                            pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"embedded engine {e.id} not ready after {timeout_s:.0f} s")
                    await asyncio.sleep(0.05)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop every engine within ``timeout_s``: SIGTERM (and SIGCONT, so a stopped one hears
        it), then SIGKILL whatever is still there at the deadline."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        for p in self.procs:
            p.wait()
            _LIVE.discard(p)
        self.procs.clear()
