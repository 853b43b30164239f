"""The embedded simulated cluster: `conductor serve` with no configuration starts sim engines
as child processes on loopback (each with KV events) and routes to them; ``[embedded] engine =
"sglang"`` starts them as SGLang engines (``--flavor sglang``) driven with SGLang's PD protocol.
Beside them, unless ``[embedded] store = false``, one ``conductor sim-store`` that the prefill
engines load from and write through to, and whose KV events feed the gateway's store tier."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp

from engines_adapters.net import free_port
from engines_adapters.sim.profiles import load_profile
from gateway.config import EmbeddedConfig, EngineConfig, StoreConfig


def _die_with_parent() -> None:
    """Runs in the child before exec: on Linux, SIGTERM the engine if the gateway dies (even by
    SIGKILL), so an embedded cluster never outlives its gateway."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() still ends the engines on a normal shutdown


#: How a sim engine is told to speak each protocol, and where its prefill's bootstrap server listens.
BOOTSTRAP_FLAGS = {"sglang": "--disaggregation-bootstrap-port", "vllm-mooncake": "--mooncake-bootstrap-port"}


def sim_flavor_args(protocol: str) -> list[str]:
    return {"vllm": ["--flavor", "vllm"], "sglang": ["--flavor", "sglang"],
            "vllm-mooncake": ["--flavor", "vllm", "--kv-connector", "mooncake"]}[protocol]


#: every embedded process alive, for a gateway that must end at once (its shutdown overran)
_LIVE: set[subprocess.Popen] = set()


def kill_all() -> None:
    """SIGKILL every embedded engine still alive (a stopped one too: SIGTERM would wait for SIGCONT)."""
    for p in list(_LIVE):
        try:
            p.kill()
        except OSError:
            pass


def hash_seed() -> str:
    """The engines' PYTHONHASHSEED (vLLM's prefix-hash chain seed, inside their store keys)."""
    return os.environ.get("PYTHONHASHSEED", "0")


class EmbeddedCluster:
    def __init__(self, cfg: EmbeddedConfig):
        self.cfg = cfg
        self.procs: list[subprocess.Popen] = []
        self.engines: list[EngineConfig] = []
        self.store: StoreConfig | None = None  # the embedded store, once started
        self._store_proc: subprocess.Popen | None = None
        self._kv_store: list[str] = []  # the engines' store flags when the store is a real master

    def use_mooncake(self, st: StoreConfig) -> None:
        """Prefill engines put and get real bytes through the Mooncake master ``st`` names (its
        ``master_rpc``) instead of a sim-store; ``st`` gets the engines' model and hash seed."""
        self._kv_store = ["--kv-store", f"mooncake://{st.master_rpc}", "--kv-store-recipe", st.key_recipe]
        st.model = st.model or load_profile(self.cfg.profile).model["name"]
        st.hash_seed = hash_seed()

    def _start_store(self, env: dict[str, str]) -> StoreConfig:
        port, events = free_port(), free_port()
        args = [sys.executable, "-m", "gateway.cli", "sim-store", "--port", str(port),
                "--kv-events", f"tcp://127.0.0.1:{events}", "--dram-gb", str(self.cfg.store_gb),
                "--nodes", str(max(1, self.cfg.prefill + self.cfg.both)), "--time-scale", str(self.cfg.time_scale)]
        self.procs.append(subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        _LIVE.add(self.procs[-1])
        self._store_proc = self.procs[-1]
        return StoreConfig(url=f"http://127.0.0.1:{port}", kv_events=f"tcp://127.0.0.1:{events}",
                           model=load_profile(self.cfg.profile).model["name"], hash_seed=env["PYTHONHASHSEED"],
                           key_recipe=self._store_recipe())

    def _store_recipe(self) -> str:
        """The engines' store keys: SGLang HiCache's for SGLang engines, vLLM's store connector's else."""
        return "sglang" if self.cfg.engine == "sglang" else "vllm"

    def plan(self) -> list[EngineConfig]:
        """The engines this cluster will run, not yet started. Each KV-event endpoint has port 0: the
        gateway binds it (the OS picks the port) before :meth:`launch` hands it to the engine, so no
        other socket can take a port between choosing and binding it."""
        roles = ["prefill"] * self.cfg.prefill + ["decode"] * self.cfg.decode + ["both"] * self.cfg.both
        counters: dict[str, int] = {}
        # the gateway gets only the public deployment the engines emulate (never their calibration),
        # time-scaled when they run at a time scale so predictions are in wall-clock seconds
        deployment = load_profile(self.cfg.profile).deployment.time_scaled(self.cfg.time_scale).name
        for role in roles:
            counters[role] = counters.get(role, 0) + 1
            protocol = self.cfg.engine
            bootstrap = free_port() if protocol not in ("vllm", "sglang") and role == "prefill" else None
            self.engines.append(EngineConfig(id=f"{role}-{counters[role]}", role=role,
                                             url=f"http://127.0.0.1:{free_port()}", kind="sim",
                                             kv_events="tcp://127.0.0.1:0",
                                             kv_events_replay=f"tcp://127.0.0.1:{free_port()}",
                                             deployment=deployment, protocol=protocol, bootstrap_port=bootstrap))
        return self.engines

    def launch(self) -> None:
        """Start the store (if any) and the planned engines, with the KV-event endpoints as bound."""
        env = {**os.environ, "PYTHONHASHSEED": hash_seed()}
        if self.cfg.store and not self._kv_store:
            self.store = self._start_store(env)
        for i, e in enumerate(self.engines):
            protocol = e.protocol
            assert protocol is not None  # plan() names each engine's protocol
            extra = sim_flavor_args(protocol)
            if protocol == "sglang" and e.role == "prefill":  # it picks a free port; /server_info names it
                extra += [BOOTSTRAP_FLAGS[protocol], "0"]
            elif e.bootstrap_port is not None:  # each prefill's bootstrap server on its own port
                extra += [BOOTSTRAP_FLAGS[protocol], str(e.bootstrap_port)]
            args = [sys.executable, "-m", "gateway.cli", "sim-engine", "--role", e.role,
                    "--port", e.url.rsplit(":", 1)[1], *extra,
                    "--kv-events", str(e.kv_events), "--kv-events-replay", str(e.kv_events_replay),
                    "--profile", self.cfg.profile, "--time-scale", str(self.cfg.time_scale),
                    "--seed", str(self.cfg.seed + i), *self.cfg.extra_args]
            if self._kv_store and e.role != "decode":  # the master answers already: not optional
                args += [*self._kv_store, "--kv-store-write", self.cfg.store_write]
            elif self.store is not None and e.role != "decode":  # optional: it starts before the store answers
                args += ["--kv-store", self.store.url, "--kv-store-optional", "--kv-store-recipe", self._store_recipe(),
                         "--kv-store-write", self.cfg.store_write]
            self.procs.append(subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
            _LIVE.add(self.procs[-1])

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Each engine answers /health (ready in ~3 s here; the margin is for a loaded 2-core box)."""
        deadline = time.monotonic() + timeout_s
        waits: list[tuple[str, str, subprocess.Popen, EngineConfig | None]] = [
            (e.id, e.url, p, e) for e, p in zip(self.engines, self.procs[-len(self.engines):], strict=True)]
        if self.store is not None:
            assert self._store_proc is not None  # started with the store
            waits.insert(0, ("store", self.store.url, self._store_proc, None))
        async with aiohttp.ClientSession() as s:
            for eid, url, p, e in waits:
                while True:
                    if p.poll() is not None:
                        raise RuntimeError(f"embedded engine {eid} exited with code {p.returncode}")
                    try:
                        async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                            if r.status == 200 and (e is None or await self._learn_bootstrap(s, e)):
                                break
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"embedded engine {eid} not ready after {timeout_s:.0f} s")
                    await asyncio.sleep(0.05)

    @staticmethod
    async def _learn_bootstrap(s: aiohttp.ClientSession, e: EngineConfig) -> bool:
        """An SGLang prefill chose its bootstrap port itself (no race for a free one): read it."""
        if e.protocol != "sglang" or e.role != "prefill" or e.bootstrap_port is not None:
            return True
        async with s.get(e.url + "/server_info", timeout=aiohttp.ClientTimeout(total=2)) as r:
            port = (await r.json()).get("disaggregation_bootstrap_port") if r.status == 200 else None
        if isinstance(port, int) and port > 0:
            e.bootstrap_port = port
        return e.bootstrap_port is not None

    def stop(self, timeout_s: float = 2.0) -> None:
        stop_processes(self.procs, timeout_s)
        self.procs.clear()


def stop_processes(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Stop every process within ``timeout_s``: SIGTERM (and SIGCONT, so a stopped one hears
    it), then SIGKILL whatever is still there at the deadline; all reaped."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    for p in procs:
        p.wait()
        _LIVE.discard(p)
