"""A real ``mooncake_master`` started by ``conductor serve`` (``[store] kind = "mooncake"``,
``start_master = true``): on 127.0.0.1 only (RPC and admin/metrics HTTP both bound there, the HTTP
metadata server left off), on ports free a moment before, stopped at shutdown within a deadline
and never outliving the gateway (PR_SET_PDEATHSIG, and the gateway's last-resort kill list).

The binary comes from the ``mooncake-transfer-engine-non-cuda`` wheel (the test extra): the
``mooncake_master`` console script beside this Python, else one on PATH, else ``[store] master_bin``.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

from engines_adapters.net import free_port
from gateway.config import GatewayConfig
from gateway.embedded import _LIVE, EmbeddedCluster, _die_with_parent, stop_processes

INSTALL_HINT = "install the test extra (pip install -e '.[test]') or pip install mooncake-transfer-engine-non-cuda"


class MasterMissing(Exception):
    """No ``mooncake_master`` binary to start."""


def find_master(explicit: str | None = None, search: list[str] | None = None) -> str:
    """The binary to run: ``explicit`` if given (it must exist), else the first ``mooncake_master``
    in ``search`` (default: beside this Python, then PATH)."""
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise MasterMissing(f"mooncake_master not found at {explicit} ([store] master_bin); {INSTALL_HINT}")
    dirs = search if search is not None else [os.path.dirname(sys.executable),
                                               *os.environ.get("PATH", "").split(os.pathsep)]
    for d in dirs:
        found = shutil.which("mooncake_master", path=d) if d else None
        if found:
            return found
    raise MasterMissing(f"mooncake_master not found (beside {sys.executable} or on PATH); {INSTALL_HINT}")


class MooncakeMaster:
    """One ``mooncake_master`` child process on loopback."""

    def __init__(self, binary: str, extra_args: list[str] | None = None):
        self.binary = binary
        self.extra_args = list(extra_args or [])
        self.rpc_port = self.http_port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def rpc(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> None:
        self.rpc_port, self.http_port = free_port(), free_port()
        while self.http_port == self.rpc_port:
            self.http_port = free_port()
        args = [self.binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
                "--metrics_host=127.0.0.1", f"--metrics_port={self.http_port}",
                "--enable_http_metadata_server=false", *self.extra_args]
        # its log goes where the gateway's does (as the embedded engines'): an operator sees why it
        # failed; warnings and up only, unless GLOG_minloglevel says otherwise (INFO logs a summary often)
        env = {"GLOG_minloglevel": "1", **os.environ}
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)
        _LIVE.add(self.proc)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + "/health", timeout=1.0) as r:
                return r.status == 200 and json.loads(r.read()).get("status") == "ok"
        except (OSError, ValueError):
            return False

    async def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Until its admin HTTP says ok; RuntimeError if it exits or does not answer in time (a port
        taken between choosing and binding, most likely: its log says)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self._healthy):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with code {self.proc.returncode} (its log is above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not answer on {self.http_url} in {timeout_s:g} s")
            await asyncio.sleep(0.05)

    def stop(self, timeout_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL at the deadline; always reaped."""
        if self.proc is not None:
            stop_processes([self.proc], timeout_s)

    def view(self) -> dict:
        p = self.proc
        return {"started_by_gateway": True, "pid": p.pid if p else None, "rpc": self.rpc, "http": self.http_url,
                "running": p is not None and p.poll() is None}


async def start_mooncake(cfg: GatewayConfig, embedded: EmbeddedCluster | None) -> MooncakeMaster | None:
    """At gateway start: the master ``[store] start_master`` asks for (its admin HTTP becomes the
    store tier's url), and the embedded engines pointed at a real master when there is one."""
    st = cfg.store
    if st is None or st.kind != "mooncake":
        return None
    master = None
    if st.start_master:
        master = MooncakeMaster(find_master(st.master_bin), st.master_args)
        master.start()
        try:
            await master.wait_ready()
        except BaseException:
            master.stop()
            raise
        st.url, st.master_rpc = master.http_url, master.rpc
    if embedded is not None and embedded.cfg.store and st.master_rpc:
        embedded.use_mooncake(st)
    return master
